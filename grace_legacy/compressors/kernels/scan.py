"""Compiled passes of CPU selection, on a tensor's magnitude bits (see
:mod:`~grace_legacy.compressors.kernels.selection`): the candidates at or above a bound (a one-sided
test: callers that must exclude NaN filter them), the k largest of them (from a histogram of their
magnitudes), and the entries whose magnitude lies in a range (Threshold's payload, written with
its wire index dtype). Why each is shaped as it is: docs/DESIGN.md#top-k-selection. The candidate
and range passes run on several threads by fixed blocks, each block's results placed after those
of the blocks before it, so the output is the serial pass's whatever the thread count.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np

from grace_legacy.compressors.kernels import compiled as _compiled

#: Candidates room is made for before the count is known, at least (a second pass is needed only
#: when more than the caller's estimate, and more than this, are found).
MIN_ROOM = 1024
#: Entries per block of the blocked candidate pass (a branch-free count first, then a scan of the
#: blocks that hold any).
BLOCK = 64
#: The blocked pass is taken below one expected candidate per this many entries (callers pass about
#: twice their estimate); with more, most blocks would be read twice.
SPARSE_BLOCKS = 128
#: Histogram bins of :func:`largest`: few enough to stay in L1, enough that the bin holding the
#: k-th largest magnitude is a small part of the candidates.
BINS = 2048


@functools.cache
def _kernels() -> SimpleNamespace:
    import numba

    compiled = _compiled.loop()

    @compiled
    def at_or_above(bits, mask, lower, positions, magnitudes):  # pragma: no cover - compiled
        found = 0
        room = positions.size
        for i in range(bits.size):
            magnitude = bits[i] & mask
            if magnitude >= lower:
                if found < room:
                    positions[found] = i
                    magnitudes[found] = magnitude
                found += 1
        return found

    @compiled
    def at_or_above_in_blocks(bits, mask, lower, positions, magnitudes):  # pragma: no cover - compiled
        found = 0
        room = positions.size
        n = bits.size
        whole = n - n % BLOCK
        for start in range(0, whole, BLOCK):
            hits = 0
            for i in range(start, start + BLOCK):  # a fixed trip count, no branch: vectorized
                hits += (bits[i] & mask) >= lower
            if hits:
                for i in range(start, start + BLOCK):
                    magnitude = bits[i] & mask
                    if magnitude >= lower:
                        if found < room:
                            positions[found] = i
                            magnitudes[found] = magnitude
                        found += 1
        for i in range(whole, n):
            magnitude = bits[i] & mask
            if magnitude >= lower:
                if found < room:
                    positions[found] = i
                    magnitudes[found] = magnitude
                found += 1
        return found

    @compiled
    def largest(positions, magnitudes, k, bins, out):  # pragma: no cover - compiled
        n = magnitudes.size
        lowest = magnitudes[0]
        highest = magnitudes[0]
        for i in range(n):
            lowest = min(lowest, magnitudes[i])
            highest = max(highest, magnitudes[i])
        shift = 0
        while ((highest - lowest) >> shift) >= bins:
            shift += 1
        counts = np.zeros(bins, np.int64)
        for i in range(n):
            counts[(magnitudes[i] - lowest) >> shift] += 1
        # The bin holding the k-th largest: every entry of a higher bin is taken.
        kth_bin = bins - 1
        taken_above = 0
        while taken_above + counts[kth_bin] < k:
            taken_above += counts[kth_bin]
            kth_bin -= 1
        in_bin = np.empty(counts[kth_bin], magnitudes.dtype)
        j = 0
        for i in range(n):
            if (magnitudes[i] - lowest) >> shift == kth_bin:
                in_bin[j] = magnitudes[i]
                j += 1
        wanted = k - taken_above
        kth = np.partition(in_bin, j - wanted)[j - wanted]
        taken = 0
        for i in range(n):
            if magnitudes[i] > kth:
                out[taken] = positions[i]
                taken += 1
        for i in range(n):  # ties at the k-th magnitude, in position order, as many as fit
            if taken == k:
                break
            if magnitudes[i] == kth:
                out[taken] = positions[i]
                taken += 1

    @compiled
    def in_range(bits, mask, lower, upper, positions, kept):  # pragma: no cover - compiled
        found = 0
        for i in range(bits.size):
            entry = bits[i]
            magnitude = entry & mask
            positions[found] = i
            kept[found] = entry
            found += (magnitude >= lower) & (magnitude <= upper)
        return found

    # On several threads, by blocks of compiled.BLOCK entries (the blocked pass's sub-blocks of
    # 64 lie within them): the candidates of every block are counted first, so each block knows
    # where its own go, then written there; the result is the serial passes' exactly.
    big = _compiled.BLOCK
    parallel = _compiled.parallel_loop()

    # Each range pass loops over a slice of its range from 0 and writes into its outputs sliced
    # from its first slot, counting those from 0 too (compiled.py: why); positions are the slice's
    # plus ``start``.
    @compiled
    def count_range(bits, mask, lower, start, end):  # pragma: no cover - compiled
        bits = bits[start:end]
        hits = 0
        for i in range(bits.size):  # no branch: vectorized
            hits += (bits[i] & mask) >= lower
        return hits

    @compiled
    def write_range(bits, mask, lower, positions, magnitudes, at, start, end, sparse):  # pragma: no cover
        bits, n = bits[start:end], end - start
        positions, magnitudes = positions[at:], magnitudes[at:]
        found = 0
        whole = n // BLOCK * BLOCK if sparse else 0
        for first in range(0, whole, BLOCK):
            hits = 0
            for i in range(first, first + BLOCK):
                hits += (bits[i] & mask) >= lower
            if hits:
                for i in range(first, first + BLOCK):
                    magnitude = bits[i] & mask
                    if magnitude >= lower:
                        positions[found] = start + i
                        magnitudes[found] = magnitude
                        found += 1
        for i in range(whole, n):
            magnitude = bits[i] & mask
            if magnitude >= lower:
                positions[found] = start + i
                magnitudes[found] = magnitude
                found += 1

    @compiled
    def candidates(bits, mask, lower, positions, magnitudes, sparse):  # pragma: no cover - compiled
        if sparse:
            return at_or_above_in_blocks(bits, mask, lower, positions, magnitudes)
        return at_or_above(bits, mask, lower, positions, magnitudes)

    @parallel
    def candidates_parallel(bits, mask, lower, positions, magnitudes, sparse):  # pragma: no cover - compiled
        n = bits.size
        count = (n + big - 1) // big
        counts = np.empty(count, np.int64)
        for b in numba.prange(count):
            counts[b] = count_range(bits, mask, lower, b * big, min(n, (b + 1) * big))
        offsets = np.empty(count, np.int64)
        total = 0
        for b in range(count):
            offsets[b] = total
            total += counts[b]
        if total > positions.size:  # the caller makes room and comes again
            return total
        for b in numba.prange(count):
            if counts[b]:
                write_range(bits, mask, lower, positions, magnitudes, offsets[b], b * big, min(n, (b + 1) * big),
                            sparse)
        return total

    @compiled
    def count_in_range(bits, mask, lower, upper, start, end):  # pragma: no cover - compiled
        bits = bits[start:end]
        hits = 0
        for i in range(bits.size):  # no branch: vectorized
            magnitude = bits[i] & mask
            hits += (magnitude >= lower) & (magnitude <= upper)
        return hits

    @parallel
    def count_in_range_parallel(bits, mask, lower, upper, counts):  # pragma: no cover - compiled
        n = bits.size
        for b in numba.prange(counts.size):
            counts[b] = count_in_range(bits, mask, lower, upper, b * big, min(n, (b + 1) * big))

    @compiled
    def write_in_range(bits, mask, lower, upper, positions, kept, at, limit, start, end):  # pragma: no cover
        # As in_range, from the block's own offset; it stops once its last entry is written, since
        # the next (unkept) store would land on the next block's first slot.
        bits = bits[start:end]
        positions, kept = positions[at:], kept[at:]
        limit -= at
        found = 0
        for i in range(bits.size):
            if found == limit:
                break
            entry = bits[i]
            magnitude = entry & mask
            positions[found] = start + i
            kept[found] = entry
            found += (magnitude >= lower) & (magnitude <= upper)

    @compiled
    def write_hits(bits, mask, lower, upper, positions, kept, found, start, first, last):  # pragma: no cover
        # The entries of bits[first:last] in the range, from slot `found`; the next free slot.
        for i in range(first, last):
            entry = bits[i]
            magnitude = entry & mask
            if (magnitude >= lower) & (magnitude <= upper):
                positions[found] = start + i
                kept[found] = entry
                found += 1
        return found

    @compiled
    def write_in_range_sparse(bits, mask, lower, upper, positions, kept, at, start, end):  # pragma: no cover
        # For few entries: each sub-block of BLOCK entries is counted without a branch, and only
        # those holding an entry are read again to write it.
        bits = bits[start:end]
        positions, kept = positions[at:], kept[at:]
        n = bits.size
        found = 0
        whole = n - n % BLOCK
        for first in range(0, whole, BLOCK):
            hits = 0
            for i in range(first, first + BLOCK):
                magnitude = bits[i] & mask
                hits += (magnitude >= lower) & (magnitude <= upper)
            if hits:
                found = write_hits(bits, mask, lower, upper, positions, kept, found, start, first, first + BLOCK)
        write_hits(bits, mask, lower, upper, positions, kept, found, start, whole, n)

    @parallel
    def write_in_range_parallel(bits, mask, lower, upper, positions, kept, offsets, counts, sparse):  # pragma: no cover
        n = bits.size
        for b in numba.prange(counts.size):
            if not counts[b]:
                continue
            if sparse:
                write_in_range_sparse(bits, mask, lower, upper, positions, kept, offsets[b], b * big,
                                      min(n, (b + 1) * big))
            else:
                write_in_range(bits, mask, lower, upper, positions, kept, offsets[b], offsets[b] + counts[b],
                               b * big, min(n, (b + 1) * big))

    return SimpleNamespace(candidates=candidates, candidates_parallel=candidates_parallel, largest=largest,
                           in_range=in_range, count_in_range_parallel=count_in_range_parallel,
                           write_in_range_parallel=write_in_range_parallel)


def candidates_at_or_above(bits: np.ndarray, mask: int, lower: int, expected: int,
                           limit: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """``(positions, magnitudes)``: the sorted positions ``i`` (int64) of the 1-D integer array
    ``bits`` with ``bits[i] & mask >= lower``, and those ``bits[i] & mask``; ``None`` once they are
    more than ``limit``. ``expected`` sizes the output (more found: a second pass)."""
    kernels = _kernels()
    sparse = expected * SPARSE_BLOCKS < bits.size

    def room_for(count):
        return np.empty(count, dtype=np.int64), np.empty(count, dtype=bits.dtype)

    def scan(positions, magnitudes):
        return _compiled.run(kernels.candidates, kernels.candidates_parallel, bits.size,
                             bits, mask, lower, positions, magnitudes, sparse)

    positions, magnitudes = room_for(min(bits.size, max(expected, MIN_ROOM)))
    found = scan(positions, magnitudes)
    if limit is not None and found > limit:
        return None
    if found > positions.size:
        positions, magnitudes = room_for(found)
        scan(positions, magnitudes)
    if 2 * found < positions.size:
        return positions[:found].copy(), magnitudes[:found].copy()
    return positions[:found], magnitudes[:found]


def largest(positions: np.ndarray, magnitudes: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` of ``positions`` with the largest ``magnitudes`` (non-negative integers): every
    one above the k-th largest magnitude, then those equal to it in the order given, as many as
    fit. ``1 <= k <= positions.size``."""
    if not 1 <= k <= positions.size or positions.size != magnitudes.size:
        raise ValueError(f"largest: need 1 <= k <= {positions.size} and as many magnitudes as "
                         f"positions, got k={k} and {magnitudes.size} magnitudes")
    out = np.empty(k, dtype=np.int64)
    _kernels().largest(positions, magnitudes, k, BINS, out)
    return out


def entries_in_range(bits: np.ndarray, mask: int, lower: int, upper: int,
                     index_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(entries, positions)``: the entries ``bits[i]`` (unmasked, so a float's sign survives a
    view back) with ``lower <= bits[i] & mask <= upper``, and their increasing positions as
    ``index_dtype``, which must hold ``bits.size - 1``."""
    kernels = _kernels()
    threads = _compiled.threads_for(bits.size)
    if threads == 1:
        # Every entry is written at the next free slot whatever the test says, so both outputs are
        # bits.size long; untouched pages of np.empty cost nothing, and a small result is copied out.
        positions = np.empty(bits.size, dtype=index_dtype)
        kept = np.empty(bits.size, dtype=bits.dtype)
        found = kernels.in_range(bits, mask, lower, upper, positions, kept)
        if 2 * found < bits.size:
            return kept[:found].copy(), positions[:found].copy()
        return kept[:found], positions[:found]
    # On several threads: each block's entries counted first (a vectorized read), then written at
    # the block's offset in outputs of the exact size; no copy afterwards, whatever the fraction kept.
    counts = np.empty(_compiled.blocks(bits.size), dtype=np.int64)
    with _compiled.launched(threads):
        kernels.count_in_range_parallel(bits, mask, lower, upper, counts)
        offsets = np.cumsum(counts) - counts
        found = int(counts.sum())
        positions, kept = np.empty(found, dtype=index_dtype), np.empty(found, dtype=bits.dtype)
        # Few entries: only the sub-blocks that hold one are read twice (the rule of the candidates).
        sparse = found * SPARSE_BLOCKS < bits.size
        kernels.write_in_range_parallel(bits, mask, lower, upper, positions, kept, offsets, counts, sparse)
    return kept, positions
