"""The compiled selection passes (``compressors/kernels/selection.py``, Threshold's in
``compressors/kernels/threshold_passes.py``) against plain numpy: the candidates mask-compare-``flatnonzero``
finds (however their arrays were first sized), and the k largest a full sort finds, for every
integer width selection uses."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy.compressors.kernels import compiled, selection
from grace_legacy.compressors.kernels.selection import candidates_at_or_above, largest
from grace_legacy.compressors.kernels.threshold_passes import entries_in_range

WIDTHS = {np.int16: 0x7FFF, np.int32: 0x7FFF_FFFF, np.int64: 0x7FFF_FFFF_FFFF_FFFF}


def random_bits(dtype, n: int, seed: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, info.max, n, dtype=dtype, endpoint=True)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(list(WIDTHS)), n=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1),
       lower_q=st.floats(0, 1), expected=st.integers(0, 6000))
def test_candidates_are_numpys_whatever_the_expected_count(dtype, n, seed, lower_q, expected):
    mask = WIDTHS[dtype]
    bits = random_bits(dtype, n, seed)
    lower = min(int(lower_q * mask), mask)  # a float product can round past the mask
    positions, magnitudes = candidates_at_or_above(bits, mask, lower, expected)
    assert positions.dtype == np.int64 and magnitudes.dtype == dtype
    np.testing.assert_array_equal(positions, np.flatnonzero(np.bitwise_and(bits, mask) >= lower))
    np.testing.assert_array_equal(magnitudes, np.bitwise_and(bits[positions], mask))


def test_more_than_the_room_made_takes_a_second_pass_and_a_small_result_lets_go_of_the_room():
    bits = np.arange(10 * selection.MIN_ROOM, dtype=np.int32)
    everything, _ = candidates_at_or_above(bits, 0x7FFF_FFFF, 0, expected=0)
    np.testing.assert_array_equal(everything, np.arange(bits.size))
    few, magnitudes = candidates_at_or_above(bits, 0x7FFF_FFFF, bits.size - 3, expected=bits.size)
    np.testing.assert_array_equal(few, [bits.size - 3, bits.size - 2, bits.size - 1])
    np.testing.assert_array_equal(magnitudes, few)
    assert few.base is None or few.base.numel() == 3  # its own memory (a tensor's, compiled.empty), not the room's


def test_the_sign_bit_is_masked_away():
    bits = np.array([-1, 5, np.iinfo(np.int32).min, 7], dtype=np.int32)  # -1 is all ones
    positions, magnitudes = candidates_at_or_above(bits, 0x7FFF_FFFF, 6, expected=1)
    assert positions.tolist() == [0, 3] and magnitudes.tolist() == [0x7FFF_FFFF, 7]


@pytest.mark.parametrize("limit, answer", [(4, None), (5, [5, 6, 7, 8, 9])])
def test_more_than_the_limit_is_none(limit, answer):
    found = candidates_at_or_above(np.arange(10, dtype=np.int16), 0x7FFF, 5, expected=1, limit=limit)
    assert found is None if answer is None else found[0].tolist() == answer


def reference_largest(positions: np.ndarray, magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Above the k-th largest magnitude, then ties in the order given: a stable sort's answer."""
    kth = np.sort(magnitudes)[magnitudes.size - k]
    above = positions[magnitudes > kth]
    return np.concatenate([above, positions[magnitudes == kth][:k - above.size]])


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from(list(WIDTHS)), n=st.integers(1, 6000), seed=st.integers(0, 2**32 - 1),
       k_q=st.floats(0, 1), distinct=st.sampled_from([2, 50, 10_000, None]))
def test_largest_is_a_full_sorts_answer(dtype, n, seed, k_q, distinct):
    rng = np.random.default_rng(seed)
    mask = WIDTHS[dtype]
    magnitudes = np.bitwise_and(random_bits(dtype, n, seed), mask)
    if distinct is not None:  # many ties, and spans narrower than the histogram's bins
        magnitudes = magnitudes % distinct + rng.integers(0, mask - distinct, dtype=dtype)
    positions = np.sort(rng.choice(10 * n, n, replace=False)).astype(np.int64)
    k = 1 + int(k_q * (n - 1))
    np.testing.assert_array_equal(largest(positions, magnitudes, k), reference_largest(positions, magnitudes, k))


def test_largest_over_the_widest_span_and_all_equal():
    top = np.iinfo(np.int64).max
    magnitudes = np.array([0, top, 1, top - 1, 2], dtype=np.int64)
    assert largest(np.arange(5), magnitudes, 2).tolist() == [1, 3]
    assert largest(np.arange(5), np.full(5, 7, dtype=np.int32), 3).tolist() == [0, 1, 2]


@pytest.mark.parametrize("k, count", [(0, 3), (4, 3), (1, 2)])
def test_largest_refuses_an_impossible_k_or_mismatched_arrays(k, count):
    with pytest.raises(ValueError, match="largest: need 1 <= k <= 3"):
        largest(np.arange(3), np.zeros(count, dtype=np.int32), k)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(list(WIDTHS)), n=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1),
       bounds=st.tuples(st.floats(0, 1), st.floats(0, 1)), index_dtype=st.sampled_from([np.int32, np.int64]))
def test_range_pass_is_numpys_mask_and_gather(dtype, n, seed, bounds, index_dtype):
    """The branch-free range pass keeps what a two-sided mask and ``flatnonzero`` keep, the
    entries unmasked (sign bits kept), whichever index width is asked for."""
    mask = WIDTHS[dtype]
    bits = random_bits(dtype, n, seed)
    lower, upper = sorted(min(int(q * mask), mask) for q in bounds)
    entries, positions = entries_in_range(bits, mask, lower, upper, index_dtype)
    magnitudes = np.bitwise_and(bits, mask)
    expected = np.flatnonzero((magnitudes >= lower) & (magnitudes <= upper))
    assert positions.dtype == index_dtype and entries.dtype == dtype
    np.testing.assert_array_equal(positions, expected)
    np.testing.assert_array_equal(entries, bits[expected])


@pytest.mark.parametrize("n", [64 * 500, 64 * 500 + 37, 50])
@pytest.mark.parametrize("expected", [1, 10_000])  # the blocked pass, and the plain one
def test_the_blocked_pass_finds_what_the_plain_pass_finds(n, expected):
    bits = random_bits(np.int32, n, n)
    lower = int(np.quantile(np.bitwise_and(bits, 0x7FFF_FFFF), 0.995))
    bits[-1] = lower  # a candidate in the last, partial block
    positions, magnitudes = candidates_at_or_above(bits, 0x7FFF_FFFF, lower, expected)
    np.testing.assert_array_equal(positions, np.flatnonzero(np.bitwise_and(bits, 0x7FFF_FFFF) >= lower))
    np.testing.assert_array_equal(magnitudes, np.bitwise_and(bits[positions], 0x7FFF_FFFF))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("kept", ["none", "every", "half", "first of each block", "last of each block", "few",
                                  "only the first of each block", "only the last of each block"])
def test_the_range_pass_by_blocks_is_numpys_mask_and_gather(kept, threads):
    """On several threads each block writes its entries at its own offset and stops at its last
    one (the next store would land on the next block's first slot), or, with few entries, writes
    only those of its sub-blocks that hold one; on one thread few entries (by the sample) are
    counted first and written so too: the output is still exactly the mask's, whichever entries
    open or close the blocks."""
    n = 3 * compiled.PER_THREAD + 37  # several blocks, the last one partial
    mask, bits = 0x7FFF_FFFF, random_bits(np.int32, n, 5)
    magnitudes = np.bitwise_and(bits, mask)
    lower, upper = {"none": (mask, mask - 1), "every": (0, mask), "few": (mask - mask // 2000, mask),
                    "only the first of each block": (mask, mask),
                    "only the last of each block": (mask, mask)}.get(kept, (mask // 2, mask))
    starts = np.arange(0, n, compiled.BLOCK)
    if kept.endswith("first of each block"):
        bits[starts] = mask  # kept
        bits[starts[1:] - 1] = 0  # and the entry before each not
    elif kept.endswith("last of each block"):
        bits[np.minimum(starts[1:], n) - 1] = mask
        bits[-1] = mask
    magnitudes = np.bitwise_and(bits, mask)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(min(threads, compiled.pool_size()))
        assert compiled.threads_for(n) > 1 or compiled.pool_size() == 1 or threads == 1
        entries, positions = entries_in_range(bits, mask, lower, upper, np.int32)
    finally:
        torch.set_num_threads(before)
    expected = np.flatnonzero((magnitudes >= lower) & (magnitudes <= upper))
    if kept.startswith(("few", "only")):
        assert 0 < expected.size * selection.SPARSE_BLOCKS < n  # the sparse write
    np.testing.assert_array_equal(positions, expected)
    np.testing.assert_array_equal(entries, bits[expected])
