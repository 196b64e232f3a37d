"""1-bit SGD (``compressors/onebit.py``): each entry decodes to the mean of its side (zero for an
empty side), the aggregate is the mean of the decoded payloads, and through ``Grace`` with
``Residual`` what one step leaves behind is sent the next."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import Grace, NoMemory, OneBit, Residual, SignSGD
from tests.helpers import synchronize
from tests.unit.test_signs import tensor_of, vote_through


def test_onebit_decodes_each_entry_to_its_sides_mean():
    x = tensor_of([3.0, -1.0, 0.0, 6.0, -3.0])
    c = OneBit()
    payload, ctx = c.compress(x, "w")
    assert torch.equal(payload[1], tensor_of([3.0, -2.0]))
    assert torch.equal(c.decompress(payload, ctx), tensor_of([3.0, -2.0, 3.0, 3.0, -2.0]))


@pytest.mark.parametrize("values,means", [([1.0, 2.0, 0.0], [1.0, 0.0]), ([-1.0, -2.0], [0.0, -1.5]),
                                          ([0.0], [0.0, 0.0]), ([-4.0], [0.0, -4.0])])
def test_onebit_empty_side_has_mean_zero(values, means):
    c = OneBit()
    payload, ctx = c.compress(tensor_of(values), "w")
    assert torch.equal(payload[1], tensor_of(means))


@given(n=st.integers(1, 64), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_onebit_means_are_the_side_means(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    c = OneBit()
    payload, ctx = c.compress(x, "w")
    decoded = c.decompress(payload, ctx)
    nonnegative = x >= 0
    assert torch.equal(decoded[nonnegative], payload[1][0].expand(int(nonnegative.sum())))
    assert torch.equal(decoded[~nonnegative], payload[1][1].expand(int((~nonnegative).sum())))
    # One side's entries share a sign, so an fp32 sum of k of them is within k units of roundoff.
    for side, mean in ((nonnegative, payload[1][0]), (~nonnegative, payload[1][1])):
        if side.any():
            exact = x[side].double().mean()
            assert abs(mean.item() - exact.item()) <= (int(side.sum()) + 1) * 2**-24 * abs(exact.item())


def test_onebit_aggregate_is_the_mean_of_decoded_payloads():
    c = OneBit()
    ranks = [tensor_of([3.0, -1.0, 1.0]), tensor_of([-2.0, 4.0, -4.0])]  # decode to [2, -1, 2] and [-3, 4, -3]
    assert torch.equal(vote_through(c, ranks, average=True), tensor_of([-0.5, 1.5, -0.5]))
    assert torch.equal(vote_through(c, ranks, average=False), tensor_of([-1.0, 3.0, -1.0]))
    assert isinstance(Grace(c).memory, Residual) and isinstance(Grace(SignSGD()).memory, NoMemory)


# Through Grace, with in-process ranks. These tensors are tiny, so Grace's dense fallback would send
# them dense; it is turned off to exercise the compressor itself (the fallback has its own tests).


def test_grace_onebit_with_residual_sends_the_error_next_step():
    bundles = [Grace(OneBit(), dense_fallback=False), Grace(OneBit(), dense_fallback=False)]
    # Rank 0 decodes to [2, -2, 2, -2] and keeps [1, 1, -1, -1]; rank 1 decodes to [1, 1, -3, -3] and
    # keeps [1, -1, 1, -1]. Next step, with zero gradients, those residuals are sent and decode exactly.
    first = synchronize(bundles, [[tensor_of([3.0, -1.0, 1.0, -3.0]), tensor_of([2.0, 0.0, -2.0, -4.0])]])
    assert all(torch.equal(r, tensor_of([1.5, -0.5, -0.5, -2.5])) for r in first[0])
    assert torch.equal(bundles[0].memory.residuals["w"], tensor_of([1.0, 1.0, -1.0, -1.0]))
    assert torch.equal(bundles[1].memory.residuals["w"], tensor_of([1.0, -1.0, 1.0, -1.0]))
    second = synchronize(bundles, [[torch.zeros(4), torch.zeros(4)]])
    assert all(torch.equal(r, tensor_of([1.0, 0.0, 0.0, -1.0])) for r in second[0])
