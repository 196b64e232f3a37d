"""DGC: exactly the entries torch.topk keeps, however unrepresentative its sample."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import DGC, Grace, Legacy, TopK
from grace_legacy.compressors.entries import kept_count
from grace_legacy.compressors.kernels.selection import top_k_at_or_above
from grace_legacy.memories.dgc import DGCMemory

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def distinct_magnitudes(n: int, seed: int = 0) -> torch.Tensor:
    """Random signs on a permutation of 1..n: no two magnitudes tie, in fp32 up to 2**24."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(n, generator=g).float() + 1.0
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return magnitudes * signs


def top_set(x: torch.Tensor, k: int) -> set[int]:
    """The k largest magnitudes by a full stable sort, not torch.topk."""
    return set(torch.sort(x.reshape(-1).abs(), descending=True, stable=True).indices[:k].tolist())


@given(n=st.integers(1, 3000), ratio=st.floats(1e-4, 1.0), seed=st.integers(0, 2**16), rank=st.integers(0, 7),
       min_samples=st.sampled_from([1, 16, 128]))
@settings(max_examples=120, deadline=None)
def test_dgc_keeps_the_same_entries_as_topk(n, ratio, seed, rank, min_samples):
    x = distinct_magnitudes(n, seed)
    c = DGC(ratio, seed=seed, min_samples=min_samples)
    c.set_rank(rank)
    k = kept_count(ratio, n)
    for _ in range(2):  # a second step draws another sample
        payload, ctx = c.compress(x, "x")
        values, indices = payload
        assert values.numel() == indices.numel() == k and indices.dtype == torch.int32
        assert set(indices.tolist()) == top_set(x, k)
        assert torch.equal(values, x[indices.long()])
        assert torch.equal(c.decompress(payload, ctx), TopK(ratio).decompress(*TopK(ratio).compress(x, "x")))


def sampled_count(c: DGC, x: torch.Tensor, name: str, step: int) -> tuple[int, int]:
    """(entries at or above DGC's threshold estimate, k) for ``x`` at ``step``, recomputed here."""
    n = x.numel()
    k = kept_count(c.ratio, n)
    sample = c.sample_indices(name, step, n)
    r = c.estimate_order(k, sample.numel(), n)
    estimate = torch.sort(x.abs()[sample], descending=True).values[r - 1]
    return int((x.abs() >= estimate).sum()), k


def arrange(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``x``'s values sorted by decreasing magnitude, placed at the positions ``first`` (in order),
    then at every other position."""
    n = x.numel()
    others = torch.tensor(sorted(set(range(n)) - set(first.tolist())), dtype=torch.long)
    out = torch.empty_like(x)
    out[torch.cat([first, others])] = x[torch.sort(x.abs(), descending=True).indices]
    return out


@given(n=st.integers(2000, 20000), ratio=st.floats(0.01, 0.3), seed=st.integers(0, 2**16),
       sample_holds=st.sampled_from(["largest", "smallest"]))
@settings(max_examples=40, deadline=None)
def test_dgc_is_exact_when_the_sample_is_as_unrepresentative_as_can_be(n, ratio, seed, sample_holds):
    c = DGC(ratio, seed=seed)
    sample = c.sample_indices("w", 0, n)
    assert sample is not None
    # The sample positions are fixed by (seed, rank, name, step) alone, so the data can be built
    # against them: the sampled positions get the largest (or the smallest) magnitudes.
    sampled = torch.unique(sample)
    x = distinct_magnitudes(n, seed)
    unsampled = torch.tensor(sorted(set(range(n)) - set(sampled.tolist())), dtype=torch.long)
    x = arrange(x, sampled if sample_holds == "largest" else unsampled)
    count, k = sampled_count(c, x, "w", 0)
    if sample_holds == "largest":
        assert count < k, "the estimate must select too few, so the fallback runs"
    else:
        assert count >= n - sampled.numel() > k, "the estimate must select nearly everything"
    payload, _ = c.compress(x, "w")
    assert set(payload[1].tolist()) == top_set(x, k)


@given(n=st.integers(2000, 20000), huge=st.integers(1, 5), seed=st.integers(0, 2**16), data=st.data())
@settings(max_examples=40, deadline=None)
def test_dgc_is_exact_when_a_few_huge_entries_escape_the_sample(n, huge, seed, data):
    k = data.draw(st.integers(1, huge))
    ratio = (k + 0.5) / n
    c = DGC(ratio, seed=seed)
    assert kept_count(ratio, n) == k
    sampled = set(torch.unique(c.sample_indices("w", 0, n)).tolist())
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g) + 1.0
    unsampled = [i for i in torch.randperm(n, generator=g).tolist() if i not in sampled][:huge]
    x[unsampled] = torch.tensor([1e6 * (i + 1) for i in range(huge)])
    count, _ = sampled_count(c, x, "w", 0)
    # The sample saw none of the huge entries: its estimate is an ordinary magnitude, which
    # every huge entry and at least one ordinary one reach.
    assert count > huge >= k
    payload, _ = c.compress(x, "w")
    assert set(payload[1].tolist()) == top_set(x, k) and set(payload[1].tolist()) <= set(unsampled)


@given(n=st.integers(1, 500), k_fraction=st.floats(0.0, 1.0), where=st.floats(-0.5, 1.5), seed=st.integers(0, 999))
@settings(max_examples=150, deadline=None)
def test_top_k_at_or_above_is_exact_for_any_threshold_estimate(n, k_fraction, where, seed):
    x = distinct_magnitudes(n, seed).abs()
    k = max(1, min(n, round(k_fraction * n)))
    # Estimates below, inside and above the range of the magnitudes.
    estimate = torch.tensor(where * (n + 1))
    assert set(top_k_at_or_above(x, k, estimate).tolist()) == top_set(x, k)


def test_dgc_leaves_the_global_rng_alone_and_samples_differently_per_rank():
    x = torch.randn(50_000)
    before = torch.random.get_rng_state()
    a, b, other = DGC(0.01, seed=3), DGC(0.01, seed=3), DGC(0.01, seed=3)
    other.set_rank(1)
    for step in range(3):
        (pa, _), (pb, _) = a.compress(x, "w"), b.compress(x, "w")
        assert torch.equal(pa[1], pb[1])
        assert torch.equal(a.sample_indices("w", step, x.numel()), b.sample_indices("w", step, x.numel()))
        assert not torch.equal(a.sample_indices("w", step, x.numel()), other.sample_indices("w", step, x.numel()))
    assert torch.equal(torch.random.get_rng_state(), before)
    base = a.sample_indices("w", 0, x.numel())
    assert base.numel() == 500 and int(base.min()) >= 0 and int(base.max()) < x.numel()
    assert not torch.equal(base, a.sample_indices("w", 1, x.numel()))
    assert not torch.equal(base, a.sample_indices("v", 0, x.numel()))
    assert not torch.equal(base, DGC(0.01, seed=4).sample_indices("w", 0, x.numel()))
    assert a.state_dict()["steps"] == {"w": 3}


def test_dgc_samples_nothing_for_tensors_smaller_than_its_sample():
    c = DGC(0.1, min_samples=128)
    assert c.sample_size(100) == 128 and c.sample_indices("w", 0, 100) is None
    assert c.sample_size(100_000) == 1000


@pytest.mark.parametrize("shape", [(), (1,), (3, 4), (2, 3, 4, 5), (300, 7)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_dgc_round_trips_any_shape_and_float_dtype(shape, dtype):
    x = torch.randn(shape).to(dtype)
    c = DGC(0.5, min_samples=16)
    payload, ctx = c.compress(x, "x")
    out = c.decompress(payload, ctx)
    assert out.shape == x.shape and out.dtype == dtype
    k = kept_count(0.5, x.numel())
    # fp16/bf16 values of randn can tie, which makes the set ambiguous but not the kept magnitudes.
    kept = torch.sort(x.reshape(-1).abs()[payload[1].long()], descending=True).values
    assert torch.equal(kept, torch.sort(x.reshape(-1).abs(), descending=True).values[:k])
    if dtype in (torch.float32, torch.float64):
        assert set(payload[1].tolist()) == top_set(x, k)


def test_dgc_payload_and_defaults():
    c = DGC(0.01)
    assert c.payload_spec(1000, torch.float32) == [(10, torch.float32), (10, torch.int32)]
    assert c.traits.uniform_payload and not c.traits.additive
    assert isinstance(c.recommended_memory(), DGCMemory)
    assert isinstance(Grace(c).memory, DGCMemory)
    assert DGC(1.0).compressor_for(torch.randn(4), "x") is None
    assert Legacy(DGC(), by="layer", values=[0.5]).compressor_for(torch.randn(4), "x").ratio == 0.5


@pytest.mark.parametrize("kwargs,message", [
    ({"ratio": 0}, r"DGC: ratio must be a number in \(0, 1\]"),
    ({"ratio": 1.5}, r"DGC: ratio must be a number in \(0, 1\]"),
    ({"ratio": 0.1, "sample_ratio": 0}, r"DGC: sample_ratio must be a number in \(0, 1\]"),
    ({"ratio": 0.1, "sample_ratio": 2.0}, r"DGC: sample_ratio must be a number in \(0, 1\]"),
    ({"ratio": 0.1, "min_samples": 0}, r"DGC: min_samples must be an integer >= 1"),
    ({"ratio": 0.1, "min_samples": 2.5}, r"DGC: min_samples must be an integer >= 1"),
])
def test_invalid_dgc_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DGC(**kwargs)


def test_dgc_seed_must_be_an_int():
    with pytest.raises(TypeError, match="DGC: seed must be an int"):
        DGC(0.1, seed=1.5)
