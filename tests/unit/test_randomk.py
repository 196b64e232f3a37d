"""Random-k (``compressors/randomk.py``): indices every rank draws alike from the seed, tensor name
and step (never from the global generator), step counters kept in the state and shared by a
schedule's configured copies; and ``uniform_subset``, which draws k distinct positions without a
full permutation, every subset equally likely."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import RandomK
from grace_legacy.compressors.randomk import uniform_subset


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


def test_with_value_copies_share_step_counters():
    base = RandomK(seed=0)
    dense, sparse = base.with_value(0.5), base.with_value(0.1)
    dense.compress(torch.randn(10), "w")
    sparse.compress(torch.randn(10), "w")
    assert base.state_dict()["steps"] == {"w": 2}


@given(n=st.integers(1, 10**7), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
@settings(max_examples=100, deadline=None)
def test_uniform_subset_is_k_distinct_values_in_range(n, fraction, seed):
    k = max(1, min(n, int(fraction * min(n, 50_000))))
    subset = uniform_subset(n, k, torch.Generator().manual_seed(seed))
    assert subset.dtype == torch.int64 and subset.numel() == k
    assert subset.unique().numel() == k and int(subset.min()) >= 0 and int(subset.max()) < n


@pytest.mark.parametrize(("n", "k"), [(9, 2), (12, 3)])
def test_uniform_subset_makes_every_subset_equally_likely(n, k):
    """Chi-square over every k-subset (the rejection path: 4k <= n), fixed seeds, so not flaky."""
    from itertools import combinations

    from scipy.stats import chisquare

    cells = {frozenset(c): 0 for c in combinations(range(n), k)}
    draws = 60 * len(cells)
    for seed in range(draws):
        cells[frozenset(uniform_subset(n, k, torch.Generator().manual_seed(seed)).tolist())] += 1
    assert chisquare(list(cells.values())).pvalue > 1e-4


def test_uniform_subset_tops_up_when_the_first_draws_repeat(monkeypatch):
    """A first stream of nothing but repeats must be topped up, not loop forever."""
    real_randint = torch.randint
    calls = []

    def randint(high, size, generator=None):
        calls.append(size)
        if len(calls) == 1:
            return torch.zeros(size, dtype=torch.int64)
        return real_randint(high, size, generator=generator)

    monkeypatch.setattr(torch, "randint", randint)
    subset = uniform_subset(1000, 50, torch.Generator().manual_seed(0))
    assert len(calls) >= 2 and subset.unique().numel() == 50 and 0 in subset.tolist()
