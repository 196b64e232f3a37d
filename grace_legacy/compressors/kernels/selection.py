"""Exact Top-k selection by magnitude: a sampled threshold, one candidate pass, then an exact top-k
among the few candidates (why: docs/DESIGN.md#top-k-selection).

1. *Estimate.* Of ``s`` sampled positions, ``mu = k s / n`` are expected among the top k; the
   sample's ``r = ceil(mu + 3 sqrt(mu)) + 1``-th largest magnitude ``t`` lies about three standard
   deviations of that count below the k-th largest, so it rarely admits too few candidates while
   their number, about ``n r / s``, stays a small multiple of ``k``.
2. *Candidates.* ``C = {i : |x_i| >= t}`` in one pass.
3. *Exact.* If ``|C| >= k`` the top k all lie in ``C``; if ``|C| < k`` every member of ``C`` beats
   every non-member, so the top k are ``C`` and the ``k - |C|`` largest of the rest. Either way the
   result is the set ``torch.topk`` picks (ties aside), whatever ``t`` was. Where ``C`` holds more
   than half the entries, a plain top-k is used.

Magnitudes compare as the floats' bit patterns with the sign bit cleared (every NaN above infinity,
where ``torch.topk`` puts it). Steps 2 and 3 are written twice: in torch (:func:`_select_torch`,
the reference, which every device other than the CPU runs) and, on a CPU, as loops compiled by
numba over the magnitude bits (:func:`candidates_at_or_above`, :func:`largest`); both pick the set
``torch.topk`` picks, ties aside, and :func:`top_k_indices` and :func:`top_k_at_or_above` pick the
way. The candidate pass runs on several threads by fixed blocks, each block's candidates placed
after those of the blocks before it, so its output is the serial pass's whatever the thread count.
Why each pass is shaped as it is: docs/DESIGN.md#top-k-selection.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled
from grace_legacy.runtime import paths

#: Below this many entries a plain ``torch.topk`` is as fast as anything (per-call overheads win).
SMALL = 1 << 15
#: Positions sampled for the estimate: the candidates stay a small multiple of ``k`` down to
#: density 0.001, at no cost next to one pass.
SAMPLES = 4096
#: Consecutive entries per sampled run (see :func:`_sample_positions`).
SAMPLE_RUN = 16
#: Standard deviations of the sampled count by which the estimate is set low.
MARGIN_SIGMAS = 3.0
#: Candidates room is made for before the count is known, at least (a second pass is needed only
#: when more than the caller's estimate, and more than this, are found).
MIN_ROOM = 1024
#: Entries per sub-block of a blocked pass (a branch-free count first, then a scan of the
#: sub-blocks that hold any).
SUB_BLOCK = 64
#: The blocked pass is taken below one expected entry per this many (callers pass about twice
#: their estimate); with more, most sub-blocks would be read twice.
SPARSE_BLOCKS = 128
#: Histogram bins of :func:`largest`: few enough to stay in L1, enough that the bin holding the
#: k-th largest magnitude is a small part of the candidates.
BINS = 2048
BLOCK = compiled.BLOCK

#: float dtype -> (same-width integer dtype, mask clearing the sign bit)
_MAGNITUDE_BITS = {
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
}
#: float dtype -> the bit pattern of +inf (every NaN's magnitude bits are above it)
INFINITY_BITS = {dtype: int(torch.tensor([float("inf")], dtype=dtype).view(int_dtype)[0])
                 for dtype, (int_dtype, _) in _MAGNITUDE_BITS.items()}


def estimate_order(k: int, samples: int, numel: int) -> int:
    """Which largest sampled magnitude (1-based) estimates the threshold (see the module doc)."""
    mu = k * samples / numel
    return math.ceil(mu + MARGIN_SIGMAS * math.sqrt(mu)) + 1


@functools.lru_cache(maxsize=512)
def _sample_positions(numel: int) -> np.ndarray:
    """Fixed pseudo-random positions for tensors of ``numel >= SAMPLE_RUN`` entries, a function of
    ``numel`` alone (deterministic, no global RNG), in runs of :data:`SAMPLE_RUN` consecutive
    entries at random places (docs/DESIGN.md#top-k-selection)."""
    starts = np.sort(np.random.default_rng(numel).integers(0, numel - SAMPLE_RUN + 1, SAMPLES // SAMPLE_RUN))
    positions = (starts[:, None] + np.arange(SAMPLE_RUN)).reshape(-1)
    positions.flags.writeable = False
    return positions


def sampled_magnitudes(bits: np.ndarray, mask: int) -> np.ndarray:
    """The magnitudes (``bits & mask``) at the :data:`SAMPLES` fixed positions of a 1-D array of at
    least :data:`SAMPLE_RUN` entries: what Top-k estimates its threshold from, and Threshold how
    many entries it keeps."""
    return np.bitwise_and(bits[_sample_positions(bits.size)], mask)


def magnitude_bits(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``flat``'s bits as integers, and the mask that turns them into comparable magnitudes."""
    try:
        int_dtype, mask = _MAGNITUDE_BITS[flat.dtype]
    except KeyError:
        raise TypeError(f"top-k selection needs a floating tensor (fp16, bf16, fp32, fp64), got {flat.dtype}") from None
    return flat.detach().contiguous().view(int_dtype), mask


def top_k_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The flat indices (int64, in no particular order) of the ``k`` entries of the 1-D ``flat``
    with the largest magnitudes: the set ``torch.topk(flat.abs(), k)`` picks, ties aside, with NaN
    above infinity above every finite magnitude."""
    numel = flat.numel()
    if not 1 <= k <= numel:
        raise ValueError(f"top-k selection: k must be in [1, {numel}], got {k}")
    if numel < SMALL or 4 * k > numel:
        return _plain_top_k(flat, k)
    if paths.cpu_path(flat):
        bits, mask = magnitude_bits(flat)
        sampled = sampled_magnitudes(bits.numpy(), mask)
        r = estimate_order(k, SAMPLES, numel)
        if r >= SAMPLES:
            return _plain_top_k(flat, k)
        threshold = np.partition(sampled, SAMPLES - r)[SAMPLES - r]
        return _select_cpu(flat, k, int(threshold), expected=numel * r // SAMPLES)
    return _top_k_indices_torch(flat, k)


def top_k_first(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The flat indices (int64, increasing) of the ``k`` entries of the 1-D ``flat`` with the largest
    magnitudes, ties at the k-th magnitude going to the lower index: the first ``k`` of a stable
    sort by magnitude, descending (NaN above infinity above every finite magnitude). A rule that
    depends on the values alone, so that an independent reference picks the same set. One pass
    more than :func:`top_k_indices`: every entry at or above the k-th magnitude it found."""
    kth = _kth_magnitude(flat, top_k_indices(flat, k))
    if paths.cpu_path(flat):
        bits, mask = magnitude_bits(flat)
        positions, magnitudes = candidates_at_or_above(bits.numpy(), mask, kth, 2 * k)
        if positions.size > k:  # ties at the k-th magnitude: the first ones
            tied = magnitudes == kth
            keep = ~tied | (np.cumsum(tied) <= k - (positions.size - int(tied.sum())))
            positions = positions[keep]
        return torch.from_numpy(positions)
    bits, mask = magnitude_bits(flat)
    magnitudes = bits.bitwise_and(mask)
    above = torch.nonzero(magnitudes > kth).reshape(-1)
    tied = torch.nonzero(magnitudes == kth).reshape(-1)[: k - above.numel()]
    return torch.cat([above, tied]).sort().values


def _kth_magnitude(flat: torch.Tensor, chosen: torch.Tensor) -> int:
    """The smallest magnitude bits among the entries of ``flat`` at ``chosen``."""
    bits, mask = magnitude_bits(flat.index_select(0, chosen.to(flat.device)))
    return int(bits.bitwise_and(mask).min())


def _top_k_indices_torch(flat: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_k_indices` for a large ``flat`` (``k <= numel / 4``) in torch, on any device."""
    numel = flat.numel()
    if numel < SAMPLES or estimate_order(k, SAMPLES, numel) >= SAMPLES:
        return _plain_top_k(flat, k)
    r = estimate_order(k, SAMPLES, numel)
    magnitudes = flat.abs()
    sample = torch.tensor(_sample_positions(numel), device=flat.device)
    threshold = torch.topk(magnitudes[sample], r, sorted=False).values.min()
    return _select_torch(magnitudes, k, threshold)


def top_k_at_or_above(flat: torch.Tensor, k: int, threshold: float | torch.Tensor) -> torch.Tensor:
    """As :func:`top_k_indices`, with the threshold estimate given (for DGC, which draws its own
    sample): exact whatever ``threshold`` is, only the work depends on it."""
    numel = flat.numel()
    if not 1 <= k <= numel:
        raise ValueError(f"top-k selection: k must be in [1, {numel}], got {k}")
    if paths.cpu_path(flat):
        estimate = torch.as_tensor(threshold, dtype=flat.dtype).abs().reshape(1)
        bits, mask = magnitude_bits(estimate)
        return _select_cpu(flat, k, int(bits.numpy()[0]) & mask, expected=2 * k)
    return _select_torch(flat.abs(), k, torch.as_tensor(threshold, device=flat.device))


def _plain_top_k(flat: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(flat.abs(), k, sorted=False).indices


def _select_cpu(flat: torch.Tensor, k: int, threshold_bits: int, expected: int) -> torch.Tensor:
    """Steps 2 and 3 of the module doc, on magnitude bits, on CPU (``expected``: about how many
    candidates the threshold admits, to size their array)."""
    bits, mask = magnitude_bits(flat)
    bits = bits.numpy()
    found = candidates_at_or_above(bits, mask, threshold_bits, 2 * expected,
                                   limit=bits.size // 2)
    if found is None:  # more than half the entries: a plain top-k is cheaper
        return _plain_top_k(flat, k)
    candidates, magnitudes = found
    count = candidates.size
    if count > k:
        return torch.from_numpy(largest(candidates, magnitudes, k))
    if count == k:
        return torch.from_numpy(candidates)
    # Rare (the estimate was too high): a second, plain pass over everything for the rest.
    all_magnitudes = np.bitwise_and(bits, mask)
    rest = np.flatnonzero(all_magnitudes < threshold_bits)
    return torch.from_numpy(np.concatenate([candidates, largest(rest, all_magnitudes[rest], k - count)]))


def _select_torch(magnitudes: torch.Tensor, k: int, threshold: torch.Tensor) -> torch.Tensor:
    """Steps 2 and 3 of the module doc in torch (any device), on the magnitudes ``|x|``."""
    # `~(m < t)` rather than `m >= t`: NaN is then a candidate, as it is largest for torch.topk.
    above = ~(magnitudes < threshold)
    candidates = torch.nonzero(above).reshape(-1)
    count = candidates.numel()
    if 2 * count > magnitudes.numel():
        return torch.topk(magnitudes, k, sorted=False).indices
    if count >= k:
        return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
    rest = torch.nonzero(~above).reshape(-1)
    extra = torch.topk(magnitudes[rest], k - count, sorted=False).indices
    return torch.cat([candidates, rest[extra]])


def candidates_at_or_above(bits: np.ndarray, mask: int, lower: int, expected: int,
                           limit: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """``(positions, magnitudes)``: the sorted positions ``i`` (int64) of the 1-D integer array
    ``bits`` with ``bits[i] & mask >= lower``, and those ``bits[i] & mask``; ``None`` once they are
    more than ``limit``. ``expected`` sizes the output (more found: a second pass)."""
    sparse = expected * SPARSE_BLOCKS < bits.size

    def room_for(count):
        return compiled.empty(count, np.int64), compiled.empty(count, bits.dtype)

    def scan(positions, magnitudes):
        return compiled.run(_candidates, _candidates_parallel, bits.size, bits, mask, lower, positions, magnitudes,
                            sparse)

    positions, magnitudes = room_for(min(bits.size, max(expected, MIN_ROOM)))
    found = scan(positions, magnitudes)
    if limit is not None and found > limit:
        return None
    if found > positions.size:
        positions, magnitudes = room_for(found)
        scan(positions, magnitudes)
    if 2 * found < positions.size:
        return compiled.copy(positions[:found]), compiled.copy(magnitudes[:found])
    return positions[:found], magnitudes[:found]


def largest(positions: np.ndarray, magnitudes: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` of ``positions`` with the largest ``magnitudes`` (non-negative integers): every
    one above the k-th largest magnitude, then those equal to it in the order given, as many as
    fit. ``1 <= k <= positions.size``. A compiled loop: a histogram of the magnitudes, then a
    partition of the one bin that holds the k-th largest."""
    if not 1 <= k <= positions.size or positions.size != magnitudes.size:
        raise ValueError(f"largest: need 1 <= k <= {positions.size} and as many magnitudes as "
                         f"positions, got k={k} and {magnitudes.size} magnitudes")
    out = compiled.empty(k, np.int64)
    _largest(positions, magnitudes, k, BINS, out)
    return out


@compiled.inline
def _keep(bits, mask, lower, first, end, offset, positions, magnitudes, found):  # pragma: no cover - compiled
    """Writes each magnitude of ``bits[first:end]`` at or above ``lower`` as the next candidate
    (its position plus ``offset``) while there is room; returns the candidates counted so far.
    A helper over a run of entries, not one entry: each call takes and drops references to the
    arrays it is handed, which per entry cost more than the comparison itself."""
    room = positions.size
    for i in range(first, end):
        magnitude = bits[i] & mask
        if magnitude >= lower:
            if found < room:
                positions[found] = offset + i
                magnitudes[found] = magnitude
            found += 1
    return found


# Where sparse, by sub-blocks: a branch-free count of each, then a scan of those that hold any.
@compiled.loop
def _candidates(bits, mask, lower, positions, magnitudes, sparse):  # pragma: no cover - compiled
    found = 0
    n = bits.size
    whole = n - n % SUB_BLOCK if sparse else 0
    for start in range(0, whole, SUB_BLOCK):
        hits = 0
        for i in range(start, start + SUB_BLOCK):  # a fixed trip count, no branch: vectorized
            hits += (bits[i] & mask) >= lower
        if hits:
            found = _keep(bits, mask, lower, start, start + SUB_BLOCK, 0, positions, magnitudes, found)
    return _keep(bits, mask, lower, whole, n, 0, positions, magnitudes, found)


# On several threads, by blocks of compiled.BLOCK entries (the blocked pass's sub-blocks lie
# within them): the candidates of every block are counted first, so each block knows where its own
# go, then written there; the result is the serial pass's exactly. Each range pass loops over a
# slice of its range from 0 and writes into its outputs sliced from its first slot, counting those
# from 0 too (compiled.py: why); positions are the slice's plus ``start``.
@compiled.loop
def _count_range(bits, mask, lower, start, end):  # pragma: no cover - compiled
    bits = bits[start:end]
    hits = 0
    for i in range(bits.size):  # no branch: vectorized
        hits += (bits[i] & mask) >= lower
    return hits


@compiled.loop
def _write_range(bits, mask, lower, positions, magnitudes, at, start, end, sparse):  # pragma: no cover
    bits, n = bits[start:end], end - start
    positions, magnitudes = positions[at:], magnitudes[at:]
    found = 0  # the block's count was made room for: every candidate fits
    whole = n // SUB_BLOCK * SUB_BLOCK if sparse else 0
    for first in range(0, whole, SUB_BLOCK):
        hits = 0
        for i in range(first, first + SUB_BLOCK):
            hits += (bits[i] & mask) >= lower
        if hits:
            found = _keep(bits, mask, lower, first, first + SUB_BLOCK, start, positions, magnitudes, found)
    _keep(bits, mask, lower, whole, n, start, positions, magnitudes, found)


@compiled.parallel_loop
def _candidates_parallel(bits, mask, lower, positions, magnitudes, sparse):  # pragma: no cover - compiled
    n = bits.size
    count = (n + BLOCK - 1) // BLOCK
    counts = np.empty(count, np.int64)
    for b in numba.prange(count):
        counts[b] = _count_range(bits, mask, lower, b * BLOCK, min(n, (b + 1) * BLOCK))
    offsets = np.empty(count, np.int64)
    total = 0
    for b in range(count):
        offsets[b] = total
        total += counts[b]
    if total > positions.size:  # the caller makes room and comes again
        return total
    for b in numba.prange(count):
        if counts[b]:
            _write_range(bits, mask, lower, positions, magnitudes, offsets[b], b * BLOCK, min(n, (b + 1) * BLOCK),
                         sparse)
    return total


@compiled.loop
def _largest(positions, magnitudes, k, bins, out):  # pragma: no cover - compiled
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
