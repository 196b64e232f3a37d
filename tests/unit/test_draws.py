"""The counter-based uniform draws the stochastic quantizers use: SplitMix64, on any device, and
the same numbers in the compiled loops."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy.compressors.kernels.draws import draw_pair, key_word, uniform

MASK = 2**64 - 1


def splitmix64(seed: int, count: int) -> list[int]:
    """Steele, Lea and Flood's SplitMix64, written from its definition in plain integers."""
    state, out = seed & MASK, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def test_first_outputs_match_published_splitmix64_vectors():
    """Seed 1234567's first outputs, the test vectors Rosetta Code's "Pseudo-random
    numbers/Splitmix64" task lists: the plain-integer version above is SplitMix64 itself."""
    assert splitmix64(1234567, 3) == [6457827717110365317, 3203168211198807973, 9817491932198370423]


@given(key=st.integers(-(2**70), 2**70), n=st.integers(0, 300))
@settings(max_examples=60, deadline=None)
def test_draws_are_the_top_bits_of_splitmix64(key, n):
    words = splitmix64(key, n)
    # Two float32 draws a word: bits 40-63, then bits 8-31.
    halves = [bits for w in words for bits in (w >> 40, (w >> 8) & 0xFFFFFF)][:n]
    want32 = torch.tensor([b / 2**24 for b in halves], dtype=torch.float32)
    want64 = torch.tensor([(w >> 11) / 2**53 for w in words], dtype=torch.float64)
    assert torch.equal(uniform(key, n), want32)
    assert torch.equal(uniform(key, n, torch.float64), want64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draws_look_uniform(dtype):
    draws = uniform(2024, 1_000_000, dtype).double()
    assert 0.0 <= float(draws.min()) and float(draws.max()) < 1.0
    counts = torch.histc(draws, bins=100, min=0.0, max=1.0)
    expected = 10_000
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 160  # 99.99th percentile of chi-square with 99 degrees of freedom: ~157
    # Neighbouring draws are uncorrelated.
    assert abs(float(torch.corrcoef(torch.stack([draws[:-1], draws[1:]]))[0, 1])) < 0.005


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_keys_a_step_apart_give_unrelated_draws(dtype):
    a, b = uniform(7, 100_000, dtype).double(), uniform(8, 100_000, dtype).double()
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32])
def test_other_dtypes_are_refused(dtype):
    with pytest.raises(TypeError, match="float32 or torch.float64"):
        uniform(1, 10, dtype)


@pytest.mark.parametrize("key", [1.5, "1", True, None])
def test_keys_must_be_ints(key):
    with pytest.raises(TypeError, match="key must be an int"):
        uniform(key, 10)


@numba.njit
def compiled_draws(key, n, like):
    """Draws 0 .. n - 1 as a compiled loop makes them, a pair at a time."""
    out = np.empty(n + n % 2, like.dtype)
    for j in range((n + 1) // 2):
        out[2 * j], out[2 * j + 1] = draw_pair(key, j, like)
    return out[:n]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("key", [0, 1234567, -5, 2**64 - 1, 2**63 + 12345])
def test_the_compiled_loops_draw_the_same_numbers(dtype, key):
    for n in (0, 1, 2, 7, 1000):
        got = compiled_draws(key_word(key), n, np.zeros(1, dtype))
        want = uniform(key, n, torch.float32 if dtype == np.float32 else torch.float64).numpy()
        assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
