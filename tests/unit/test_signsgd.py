"""SignSGD and Signum (``compressors/signsgd.py``): the sign sent for zero, -0.0 and NaN; the
majority vote (ties give zero, ``average`` is ignored, more ranks than int16 can double); Signum's
momentum recurrence, state and checks; and both voting through ``Grace`` on four ranks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import Grace, SignSGD, Signum
from grace_legacy.compressors.kernels.bits import pack_bits
from grace_legacy.compressors.signs import SignContext
from grace_legacy.compressors.signsgd import majority_vote
from tests.helpers import synchronize
from tests.unit.test_signs import DTYPES, dyadic, shapes, tensor_of, vote_through


def test_signsgd_sends_plus_one_for_zero_and_negative_zero_and_minus_one_for_nan():
    x = tensor_of([2.0, -3.0, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1e-30])
    c = SignSGD()
    assert torch.equal(c.decompress(*c.compress(x, "x")), tensor_of([1, -1, 1, 1, -1, 1, -1, -1]))


def test_majority_vote_ties_give_zero_and_average_is_ignored():
    ranks = [tensor_of([1.0, 1.0, 1.0, -1.0, 0.0]), tensor_of([1.0, -1.0, 2.0, -1.0, 0.0]),
             tensor_of([-1.0, -1.0, 3.0, -1.0, 0.0]), tensor_of([-1.0, 1.0, -4.0, 1.0, 0.0])]
    expected = tensor_of([0.0, 0.0, 1.0, -1.0, 1.0])
    assert torch.equal(vote_through(SignSGD(), ranks, average=True), expected)
    assert torch.equal(vote_through(SignSGD(), ranks, average=False), expected)
    assert torch.equal(vote_through(SignSGD(), ranks[:3]), tensor_of([1.0, -1.0, 1.0, -1.0, 1.0]))


@given(world=st.integers(1, 6), shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_majority_vote_is_sign_of_summed_signs(world, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ranks = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
    signs = [torch.where(r >= 0, 1, -1) for r in ranks]
    expected = torch.sign(sum(signs)).to(dtype)
    out = vote_through(SignSGD(), ranks)
    assert out.dtype == dtype and out.shape == shape and torch.equal(out, expected)


# -- Signum ------------------------------------------------------------------------------------------


def test_signum_sends_the_sign_of_the_momentum_not_of_the_gradient():
    c = Signum(momentum=0.5)
    sent = []
    for g in ([4.0, -4.0], [1.0, -1.0], [-1.0, 1.0], [-8.0, 8.0]):
        payload, ctx = c.compress(tensor_of(g), "w")
        sent.append(c.decompress(payload, ctx).tolist())
    # m: [2, -2], [1.5, -1.5], [0.25, -0.25], [-3.875, 3.875] (all exact in binary)
    assert torch.equal(c.momentum_buffers["w"], tensor_of([-3.875, 3.875]))
    assert sent == [[1, -1], [1, -1], [1, -1], [-1, 1]]


@given(momentum=st.sampled_from([0.0, 0.25, 0.5, 0.75]),
       steps=st.lists(st.lists(st.integers(-64, 64), min_size=5, max_size=5), min_size=1, max_size=5))
@settings(max_examples=60, deadline=None)
def test_signum_momentum_follows_its_recurrence(momentum, steps):
    # Integer gradients and dyadic momenta keep every value exact in fp32 and fp64 for 5 steps.
    c = Signum(momentum)
    m = torch.zeros(5, dtype=torch.float64)
    for g in steps:
        payload, ctx = c.compress(tensor_of(g), "w")
        m = momentum * m + (1 - momentum) * tensor_of(g, torch.float64)
        assert torch.equal(c.momentum_buffers["w"].double(), m)
        assert torch.equal(c.decompress(payload, ctx), torch.where(m >= 0, 1.0, -1.0).float())


def test_signum_with_zero_momentum_is_signsgd():
    g = torch.Generator().manual_seed(3)
    c, plain = Signum(0.0), SignSGD()
    for _ in range(3):
        x = torch.randn(50, generator=g)
        assert torch.equal(c.compress(x, "w")[0][0], plain.compress(x, "w")[0][0])


def test_signum_state_dict_round_trip_is_a_copy():
    g = torch.Generator().manual_seed(0)
    a = Signum(0.9)
    for _ in range(2):
        a.compress(torch.randn(4, 3, generator=g), "w")
        a.compress(torch.randn(()), "s")
    state = a.state_dict()
    saved = state["momentum_buffers"]["w"].clone()
    b = Signum(0.9)
    b.load_state_dict(state)
    x = torch.randn(4, 3, generator=g)
    assert torch.equal(a.compress(x, "w")[0][0], b.compress(x, "w")[0][0])
    assert torch.equal(a.momentum_buffers["w"], b.momentum_buffers["w"])
    assert torch.equal(state["momentum_buffers"]["w"], saved)  # compressing did not touch the saved state
    assert b.momentum_buffers["s"].shape == ()


def test_signum_keeps_half_precision_momentum_in_fp32():
    c = Signum(0.9)
    for dtype in (torch.float16, torch.bfloat16):
        c.compress(torch.randn(6).to(dtype), str(dtype))
        assert c.momentum_buffers[str(dtype)].dtype == torch.float32
    c.compress(torch.randn(6, dtype=torch.float64), "d")
    assert c.momentum_buffers["d"].dtype == torch.float64


def test_signum_refuses_a_tensor_that_changed_shape():
    c = Signum()
    c.compress(torch.randn(3), "w")
    with pytest.raises(ValueError, match="changed from"):
        c.compress(torch.randn(4), "w")


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, float("nan"), float("inf")])
def test_signum_momentum_must_be_in_zero_one(bad):
    with pytest.raises(ValueError, match=r"Signum: momentum must be a number in \[0, 1\)"):
        Signum(bad)


@pytest.mark.parametrize("bad", [None, "0.9", True, torch.tensor(0.9)])
def test_signum_momentum_of_wrong_type(bad):
    with pytest.raises(TypeError, match="Signum: momentum"):
        Signum(bad)


# Through Grace, with in-process ranks. These tensors are tiny, so Grace's dense fallback would send
# them dense; it is turned off to exercise the compressor itself (the fallback has its own tests).


def test_grace_signsgd_and_signum_vote_with_ties_on_four_ranks():
    steps = [[tensor_of([1.0, -1.0, 2.0]), tensor_of([1.0, 1.0, -2.0]), tensor_of([-1.0, -1.0, 0.0]),
              tensor_of([-1.0, -1.0, 1.0])]]
    for make in (SignSGD, lambda: Signum(0.5)):
        for average in (True, False):
            results = synchronize([Grace(make(), dense_fallback=False) for _ in range(4)], steps, average)
            assert all(torch.equal(r, tensor_of([0.0, -1.0, 1.0])) for r in results[0])


def test_grace_counts_the_packed_bytes():
    world, n = 2, 70
    bundles = [Grace(SignSGD(), dense_fallback=False) for _ in range(world)]
    synchronize(bundles, [dyadic(0, n, world)])
    assert bundles[0].stats["bytes_sent"] == 16 and bundles[0].stats["bytes_dense"] == 4 * n


def test_a_vote_of_more_ranks_than_int16_can_double_still_counts_right():
    ctx = SignContext(torch.Size([3]), 3, torch.float32, torch.device("cpu"))
    yes, no = pack_bits(torch.tensor([True, False, True])), pack_bits(torch.tensor([False, False, True]))
    # 8,193 + 8,192 = 16,385 ranks: 2 * ranks overflows int16.
    vote = majority_vote([[yes]] * 8193 + [[no]] * 8192, ctx)
    assert torch.equal(vote, torch.tensor([1.0, -1.0, 1.0]))
    tie = majority_vote([[yes]] * 8192 + [[no]] * 8192, ctx)
    assert torch.equal(tie, torch.tensor([0.0, -1.0, 1.0]))
