"""Sparse payloads decoded and summed (``compressors/sparse.py``): the index dtype, ``densify``,
the rank-by-rank ``scatter_sum`` and a bucket's one ``scatter_sum_many``, both bit for bit what
adding the decoded payloads gives (signed zeros, infinities and NaN included), and dividing only
the written entries of a sum as dividing all of it."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy.compressors.kernels import compiled
from grace_legacy.compressors.sparse import (
    SparseContext,
    densify,
    divide_written,
    index_dtype,
    scatter_sum,
    scatter_sum_many,
)
from tests.helpers import bits


def test_index_dtype_switches_to_int64_only_at_2_to_the_31():
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64


def scattered_by_hand(values: list[float], indices: list[int], numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A decompressed payload built entry by entry, with no scatter kernel."""
    dense = torch.zeros(numel, dtype=dtype)
    for value, index in zip(values, indices, strict=True):
        dense[index] = value
    return dense


ENTRY_VALUES = st.one_of(st.sampled_from([0.0, -0.0, 2.5, -1e-3, float("inf"), float("-inf")]),
                         st.floats(-1e4, 1e4))


@given(data=st.data(), world=st.integers(1, 4), numel=st.integers(1, 30), average=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       index_dtype=st.sampled_from([torch.int32, torch.int64]))
@settings(max_examples=120, deadline=None)
def test_scatter_sum_is_the_rank_by_rank_sum_of_decompressed_payloads_bit_for_bit(
        data, world, numel, average, dtype, index_dtype):
    """Each rank's indices distinct (as Top-k's are), ranks overlapping; signed zeros and infinities."""
    k = data.draw(st.integers(1, numel))
    payloads, want = [], torch.zeros(numel, dtype=dtype)
    for _ in range(world):
        indices = data.draw(st.lists(st.integers(0, numel - 1), min_size=k, max_size=k, unique=True))
        values = data.draw(st.lists(ENTRY_VALUES, min_size=k, max_size=k))
        payloads.append([torch.tensor(values, dtype=dtype), torch.tensor(indices, dtype=index_dtype)])
        want = want + scattered_by_hand(values, indices, numel, dtype)
    if average:
        want = want / world
    got = scatter_sum(payloads, SparseContext(torch.Size([numel]), numel, dtype, torch.device("cpu")), average)
    nan = want.isnan()  # inf - inf; a NaN's sign is not part of the contract
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(bits(got[~nan]), bits(want[~nan]))


@given(data=st.data(), numel=st.integers(1, 30), index_dtype=st.sampled_from([torch.int32, torch.int64]))
@settings(max_examples=60, deadline=None)
def test_densify_puts_each_value_at_its_index_and_zeros_elsewhere(data, numel, index_dtype):
    k = data.draw(st.integers(1, numel))
    indices = data.draw(st.lists(st.integers(0, numel - 1), min_size=k, max_size=k, unique=True))
    values = data.draw(st.lists(ENTRY_VALUES, min_size=k, max_size=k))
    ctx = SparseContext(torch.Size([1, numel]), numel, torch.float32, torch.device("cpu"))
    got = densify(torch.tensor(values), torch.tensor(indices, dtype=index_dtype), ctx)
    assert got.shape == (1, numel)
    assert torch.equal(bits(got), bits(scattered_by_hand(values, indices, numel, torch.float32)))


def test_densify_refuses_a_value_count_unlike_the_index_count():
    ctx = SparseContext(torch.Size([10]), 10, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="one value per index, got \\(3,\\) values for \\(2,\\) indices"):
        densify(torch.ones(3), torch.tensor([1, 2]), ctx)


SPECIALS = [float("nan"), float("inf"), float("-inf")]


ENTRY_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@given(data=st.data(), world=st.integers(1, 4), average=st.booleans())
@settings(max_examples=150, deadline=None)
def test_one_scatter_add_for_a_bucket_is_each_members_scatter_sum_bit_for_bit(data, world, average):
    """Repeated indices, signed zeros, infinities and NaN included, members of several dtypes."""
    members = []
    for _ in range(data.draw(st.integers(1, 5))):
        numel = data.draw(st.integers(1, 40))
        k = data.draw(st.integers(0, 12))
        dtype = data.draw(st.sampled_from(ENTRY_DTYPES))
        index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
        pool = [0.0, -0.0, 1.5, -2.25, 1e-3, 3e4, *SPECIALS]
        values = torch.tensor(data.draw(st.lists(st.lists(st.one_of(st.sampled_from(pool), st.floats(-1e3, 1e3)),
                                                          min_size=k, max_size=k), min_size=world, max_size=world)),
                              dtype=torch.float64).reshape(world, k).to(dtype)
        indices = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, numel - 1), min_size=k, max_size=k),
                                                  min_size=world, max_size=world)), dtype=torch.int64)
        shape = data.draw(st.sampled_from([(numel,), (1, numel)]))
        ctx = SparseContext(torch.Size(shape), numel, dtype, torch.device("cpu"))
        members.append((values, indices.reshape(world, k).to(index_dtype), ctx))
    joint = scatter_sum_many(members, average)
    for (values, indices, ctx), got in zip(members, joint, strict=True):
        want = scatter_sum([[values[r], indices[r]] for r in range(world)], ctx, average)
        assert got.shape == want.shape and got.dtype == want.dtype
        # Bit patterns (so -0.0 != 0.0), except a NaN's sign and payload, which torch's kernels
        # do not keep alike (seen for bfloat16 between int32 and int64 indices).
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(bits(got[~nan]), bits(want[~nan]))


@pytest.mark.parametrize("divisor", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_dividing_the_written_entries_equals_dividing_everything(divisor, dtype):
    generator = torch.Generator().manual_seed(divisor)
    for count in (5, 300):  # few entries (only those divided) and many (a plain division)
        indices = torch.randint(0, 1000, (count,), generator=generator, dtype=torch.int32)  # with repeats
        out = torch.zeros(1000, dtype=dtype)
        out.scatter_add_(0, indices.long(), torch.randn(count, generator=generator).to(dtype))
        out[indices[0]] = -0.0
        want = out / divisor
        divide_written(out, indices, divisor)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (dtype, count)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("order", ["increasing", "shuffled", "repeated"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_compiled_scatter_writes_as_torch_in_index_order(index_dtype, order, threads, monkeypatch):
    """``densify``'s compiled pass against numpy's assignment (in index order, the last value of a
    repeated index winning), on several blocks and threads; the same bits whatever the order the
    blocks ran in."""
    numel = 3 * compiled.BLOCK + 5
    g = torch.Generator().manual_seed(7)
    indices = torch.randperm(numel, generator=g)[: 2 * compiled.BLOCK + 9].sort().values
    if order == "shuffled":
        indices = indices[torch.randperm(indices.numel(), generator=g)]
    elif order == "repeated":  # the first block's first index again in the last block
        indices[-1] = indices[0]
    values = torch.randn(indices.numel(), generator=g)
    want = np.zeros(numel, dtype=np.float32)
    want[indices.numpy()] = values.numpy()  # numpy assigns in index order: a repeat's last value stays
    monkeypatch.setattr(compiled, "PER_THREAD", 1)  # several threads even for this size
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ctx = SparseContext(torch.Size([numel]), numel, torch.float32, torch.device("cpu"))
        got = densify(values, indices.to(index_dtype), ctx)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.parametrize("bad", [-1, 10])
def test_the_compiled_scatter_refuses_an_index_outside_the_tensor(bad):
    ctx = SparseContext(torch.Size([10]), 10, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="1 index\\(es\\) outside a tensor of 10 elements"):
        densify(torch.ones(3), torch.tensor([0, bad, 9], dtype=torch.int32), ctx)
