
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import Grace, RandomK, TopK
from grace_legacy.compressors.entries import kept_count
from grace_legacy.compressors.sparse import SparseContext, densify, index_dtype, scatter_sum
from tests.helpers import bits


def distinct_magnitudes(n: int, seed: int = 0) -> torch.Tensor:
    """Random signs on a permutation of distinct magnitudes: top-k has no ties."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(n, generator=g).float() + 1.0
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return magnitudes * signs


@pytest.mark.parametrize("ratio,numel,k", [(0.01, 100, 1), (0.29, 100, 29), (0.001, 999, 1), (0.5, 7, 3),
                                           (1.0, 13, 13), (0.07, 100, 7), (1e-9, 5, 1)])
def test_kept_count_reads_the_ratio_as_written(ratio, numel, k):
    assert kept_count(ratio, numel) == k


def test_index_dtype_switches_to_int64_only_at_2_to_the_31():
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64


@given(n=st.integers(1, 3000), ratio=st.floats(1e-4, 1.0), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_topk_keeps_exactly_the_k_largest_magnitudes(n, ratio, seed):
    x = distinct_magnitudes(n, seed)
    payload, ctx = TopK(ratio).compress(x, "x")
    values, indices = payload
    k = kept_count(ratio, n)
    assert values.numel() == indices.numel() == k
    assert indices.dtype == torch.int32 and values.dtype == x.dtype
    expected = set(torch.sort(x.abs(), descending=True).indices[:k].tolist())
    assert set(indices.tolist()) == expected
    restored = TopK(ratio).decompress(payload, ctx)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[list(expected)] = True
    assert torch.equal(restored[mask], x[mask])
    assert torch.count_nonzero(restored[~mask]) == 0


@pytest.mark.parametrize("shape", [(), (1,), (3, 4), (2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_topk_round_trips_any_shape_and_float_dtype(shape, dtype):
    x = torch.randn(shape).to(dtype)
    compressor = TopK(0.5)
    out = compressor.decompress(*compressor.compress(x, "x"))
    assert out.shape == x.shape and out.dtype == dtype


def test_topk_aggregate_equals_sum_of_decompressed():
    c = TopK(0.1)
    tensors = [torch.randn(50, 3) for _ in range(4)]
    compressed = [c.compress(t, "w") for t in tensors]
    ctx = compressed[0][1]
    expected = sum(c.decompress(p, ctx) for p, _ in compressed) / 4
    assert torch.allclose(c.aggregate([p for p, _ in compressed], ctx, average=True), expected, rtol=0, atol=1e-7)


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


def test_randomk_indices_agree_across_instances_and_leave_global_rng_alone():
    x = torch.randn(1000)
    before = torch.random.get_rng_state()
    a, b = RandomK(0.1, seed=3), RandomK(0.1, seed=3)
    for _ in range(3):
        (pa, ca), (pb, cb) = a.compress(x, "layer.weight"), b.compress(x, "layer.weight")
        assert torch.equal(ca[0], cb[0]) and torch.equal(pa[0], pb[0])
    assert torch.equal(torch.random.get_rng_state(), before)


def test_randomk_indices_change_with_step_name_and_seed():
    c = RandomK(0.1, seed=0)
    base = c.indices("w", 0, 1000)
    assert len(set(base.tolist())) == 100
    assert not torch.equal(base, c.indices("w", 1, 1000))
    assert not torch.equal(base, c.indices("v", 0, 1000))
    assert not torch.equal(base, RandomK(0.1, seed=1).indices("w", 0, 1000))


def test_randomk_step_counter_survives_state_dict():
    a = RandomK(0.2, seed=5)
    x = torch.randn(200)
    a.compress(x, "w")
    b = RandomK(0.2, seed=5)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.compress(x, "w")[1][0], b.compress(x, "w")[1][0])


def test_with_knob_copies_share_step_counters():
    base = RandomK(seed=0)
    dense, sparse = base.with_value(0.5), base.with_value(0.1)
    dense.compress(torch.randn(10), "w")
    sparse.compress(torch.randn(10), "w")
    assert base.state_dict()["steps"] == {"w": 2}


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_invalid_ratio_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"TopK: ratio must be a number in \(0, 1\]"):
        TopK(bad)


@pytest.mark.parametrize("bad", ["0.1", True, [0.1], torch.tensor(0.1)])
def test_ratio_of_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="ratio"):
        RandomK(bad)


def test_compressor_without_its_knob_refuses_to_run_alone():
    with pytest.raises(ValueError, match=r"TopK\(\) was built without its ratio.*Legacy"):
        Grace(TopK())
    with pytest.raises(ValueError, match="without its ratio"):
        TopK().compress(torch.randn(4), "x")


@pytest.mark.parametrize("compressor", [TopK(0.1), RandomK(0.1)])
def test_bad_tensors_are_refused_clearly(compressor):
    with pytest.raises(ValueError, match="empty tensor"):
        compressor.compress(torch.zeros(0, 3), "x")
    with pytest.raises(TypeError, match="floating point"):
        compressor.compress(torch.arange(10), "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        compressor.compress([1.0, 2.0], "x")


def test_density_one_means_dense():
    assert TopK(1.0).compressor_for(torch.randn(5), "x") is None
    assert TopK(0.5).compressor_for(torch.randn(5), "x") is not None
