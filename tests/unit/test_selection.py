"""Fast selection (``compressors/kernels/selection.py``): the same Top-k entries as
``torch.topk(x.abs(), k)`` (ties aside), whatever the data, the dtype or the threshold estimate,
non-finite entries first, deterministically and without the global generators; and Threshold's
entries at or above a bound (``compressors/kernels/threshold_passes.py``), exactly those
``torch.nonzero(|x| >= t)`` finds, on both routes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import DGC, TopK
from grace_legacy.compressors.entries import kept_count
from grace_legacy.compressors.kernels import selection
from grace_legacy.compressors.kernels.selection import (
    SMALL,
    _select_torch,
    _top_k_indices_torch,
    top_k_at_or_above,
    top_k_indices,
)
from grace_legacy.compressors.kernels.threshold_passes import entries_at_or_above, magnitude_bound
from tests.helpers import bits

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Around the size where the fast path starts, and well above it.
SIZES = [1, 2, 7, 100, selection.SMALL - 1, selection.SMALL, 50_000, 200_003]
KINDS = ["randn", "few values", "constant", "mostly zeros", "non-finite", "sorted", "scaled by position"]


def make(kind: str, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "few values":  # heavy ties
        x = torch.randint(-3, 4, (n,), generator=g).double()
    elif kind == "constant":
        x = torch.full((n,), -0.5, dtype=torch.float64)
    elif kind == "mostly zeros":
        x = x * (torch.rand(n, generator=g) < 0.002)
    elif kind == "non-finite":
        where = torch.randint(0, n, (max(1, n // 500),), generator=g)
        x[where] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)[
            torch.randint(0, 3, (where.numel(),), generator=g)]
    elif kind == "sorted":  # the sample's positions say nothing about where the large ones are
        x = torch.sort(x.abs()).values
    elif kind == "scaled by position":
        x = x * torch.linspace(0, 1e3, n, dtype=torch.float64)
    return x.to(dtype)


def check_top_k(x: torch.Tensor, k: int, chosen: torch.Tensor) -> None:
    """``chosen`` holds k distinct positions whose magnitudes are the k largest (NaN largest), and
    equals torch.topk's set wherever the k-th and (k+1)-th largest magnitudes differ."""
    assert chosen.dtype == torch.int64 and chosen.dim() == 1 and chosen.numel() == k
    assert torch.unique(chosen).numel() == k
    magnitudes = x.abs()
    expected = torch.topk(magnitudes, k).indices
    # Sorted magnitudes; NaN compares unequal, so compare NaN-ness and the rest apart.
    got, want = torch.sort(magnitudes[chosen]).values, torch.sort(magnitudes[expected]).values
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    ordered = torch.sort(magnitudes, descending=True, stable=True).values
    boundary_tied = k < x.numel() and (ordered[k - 1] == ordered[k] or (ordered[k - 1].isnan() and ordered[k].isnan()))
    if not boundary_tied:
        assert set(chosen.tolist()) == set(expected.tolist())


@given(n=st.sampled_from(SIZES), ratio=st.sampled_from([1e-4, 0.001, 0.01, 0.1, 0.3, 1.0]),
       kind=st.sampled_from(KINDS), dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_top_k_indices_selects_what_torch_topk_selects(n, ratio, kind, dtype, seed):
    x = make(kind, n, dtype, seed)
    k = kept_count(ratio, n)
    check_top_k(x, k, top_k_indices(x, k))
    if 4 * k <= n:  # the torch code other devices run, exercised here on CPU
        check_top_k(x, k, _top_k_indices_torch(x, k))


@given(n=st.sampled_from([1, 9, 500, 40_000]), k_fraction=st.floats(0.0, 1.0), dtype=st.sampled_from(FLOATS),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 999),
       estimate=st.sampled_from(["zero", "negative", "median", "max", "above max", "inf", "nan", "tiny"]))
@settings(max_examples=80, deadline=None)
def test_any_threshold_estimate_gives_the_exact_top_k_on_cpu_and_in_the_device_code(
        n, k_fraction, dtype, kind, seed, estimate):
    x = make(kind, n, dtype, seed)
    k = max(1, min(n, round(k_fraction * n)))
    finite = x.abs()[torch.isfinite(x)].double()
    scale = float(finite.max()) if finite.numel() else 1.0
    threshold = {"zero": 0.0, "negative": -1.0, "median": float(finite.median()) if finite.numel() else 1.0,
                 "max": scale, "above max": 2 * scale + 1, "inf": float("inf"), "nan": float("nan"),
                 "tiny": 1e-30}[estimate]
    check_top_k(x, k, top_k_at_or_above(x, k, threshold))
    # The torch code other devices run, exercised here on CPU.
    check_top_k(x, k, _select_torch(x.abs(), k, torch.tensor(threshold, dtype=x.dtype).abs()))


def test_both_fallbacks_run_and_stay_exact():
    x = make("randn", 100_000, torch.float32, 1)
    k = 1000
    # Too high: fewer than k candidates, the rest come from a second pass.
    check_top_k(x, k, top_k_at_or_above(x, k, 3.9))
    # Too low: more than half the entries are candidates, a plain top-k is used.
    check_top_k(x, k, top_k_at_or_above(x, k, 0.1))


def test_non_finite_entries_are_kept_first_by_topk_and_dgc():
    x = make("randn", 60_000, torch.float32, 2)
    x[[5, 70, 50_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for compressor in (TopK(0.001), DGC(0.001)):
        (values, indices), _ = compressor.compress(x, "w")
        assert {5, 70, 50_000} <= set(indices.tolist())
        assert values[indices == 5].isnan().all() and values[indices == 70].isposinf().all()


def test_selection_is_deterministic_and_leaves_the_global_rngs_alone():
    x = make("randn", 80_000, torch.float32, 3)
    before = torch.random.get_rng_state()
    first, second = top_k_indices(x, 800), top_k_indices(x, 800)
    assert torch.equal(torch.sort(first).values, torch.sort(second).values)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"k must be in \[1, 5\]"):
        top_k_indices(torch.randn(5), 6)
    with pytest.raises(ValueError, match=r"k must be in \[1, 5\]"):
        top_k_at_or_above(torch.randn(5), 0, 1.0)
    with pytest.raises(TypeError, match="needs a floating tensor"):
        top_k_indices(torch.arange(100_000), 10)


# -- Threshold's entries at or above a bound --------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIALS = [float("nan"), float("inf"), float("-inf")]


@given(n=st.one_of(st.integers(1, 1000), st.integers(SMALL, SMALL + 100_000)), dtype=st.sampled_from(DTYPES),
       threshold=st.floats(0.0, 5.0),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS + [0.0, -0.0])), max_size=6),
       seed=st.integers(0, 2**16), index_dtype=st.sampled_from([torch.int32, torch.int64]))
@settings(max_examples=150, deadline=None)
def test_threshold_entries_equal_torch_nonzero_and_a_gather(n, dtype, threshold, specials, seed, index_dtype):
    """Both routes (torch below SMALL entries, the compiled range pass above) keep exactly the
    entries ``torch.nonzero(|x| >= bound)`` finds, at every fraction kept, with their values bit for
    bit (signed zeros) and positions in the wire's index dtype."""
    flat = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    for position, value in specials:
        flat[position % n] = value
    bound = magnitude_bound(threshold, dtype)[0]
    expected = torch.nonzero(flat.abs() >= bound).reshape(-1)
    values, indices = entries_at_or_above(flat, threshold, index_dtype)
    assert indices.dtype == index_dtype and values.dtype == dtype
    assert torch.equal(indices.long(), expected)
    assert torch.equal(bits(values), bits(flat[expected]))


@pytest.mark.parametrize("numel", [5, SMALL])
def test_threshold_entries_with_an_infinite_bound_are_the_infinities(numel):
    flat = torch.zeros(numel)
    flat[:5] = torch.tensor([1.0, float("inf"), float("nan"), -float("inf"), 3e38])
    values, indices = entries_at_or_above(flat, float("inf"), torch.int32)
    assert indices.tolist() == [1, 3] and values.tolist() == [float("inf"), -float("inf")]


def test_threshold_entries_when_none_or_all_pass():
    flat = torch.randn(SMALL, generator=torch.Generator().manual_seed(3))
    values, indices = entries_at_or_above(flat, 100.0, torch.int32)
    assert values.numel() == 0 and indices.numel() == 0 and indices.dtype == torch.int32
    values, indices = entries_at_or_above(flat, 0.0, torch.int32)
    assert torch.equal(indices, torch.arange(SMALL, dtype=torch.int32)) and torch.equal(values, flat)
