"""Threshold's pass (:class:`~grace_legacy.Threshold`): the entries whose magnitude reaches a
threshold, and their positions.

The definition is ``i = torch.nonzero(|x| >= t)`` and ``x[i]`` (:func:`entries_at_or_above_reference`,
which every device other than the CPU runs, and which a CPU runs below
:data:`~grace_legacy.compressors.kernels.selection.SMALL` entries). On a CPU a loop compiled by
numba compares magnitude bits (:func:`~grace_legacy.compressors.kernels.selection.magnitude_bits`)
with the bits of the least value of the dtype at or above ``t`` (:func:`magnitude_bound`), and
writes each kept entry with its position in the wire's index dtype; :func:`entries_at_or_above`
picks the way. The same entries either way, NaN never. On several threads the pass goes by fixed
blocks, each block's entries placed after those of the blocks before it, so its output is the
serial pass's whatever the thread count. Why the loop is shaped as it is:
docs/DESIGN.md#top-k-selection.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled
from grace_legacy.compressors.kernels.selection import (
    INFINITY_BITS,
    SAMPLES,
    SMALL,
    SPARSE_BLOCKS,
    SUB_BLOCK,
    magnitude_bits,
    sampled_magnitudes,
)
from grace_legacy.runtime import paths

BLOCK = compiled.BLOCK
#: the index dtypes of a sparse payload, as numpy spells them
_NUMPY_INDEX = {torch.int32: np.int32, torch.int64: np.int64}


@functools.lru_cache(maxsize=256)
def magnitude_bound(threshold: float, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The smallest value of ``dtype`` that is ``>= threshold`` (a 0-dim tensor, possibly ``inf``),
    and its magnitude bits: ``|x| >= bound`` holds exactly when ``|x| >= threshold`` does, for
    every ``x`` of ``dtype`` (rounding to nearest would not: fp16's nearest to 0.1 is below it).
    Cached: a threshold stays for many steps."""
    exact = torch.tensor(threshold, dtype=torch.float64)
    bound = exact.to(dtype)
    if bound.to(torch.float64) < exact:
        bound = torch.nextafter(bound, torch.tensor(float("inf"), dtype=dtype))
    bits, mask = magnitude_bits(bound.reshape(1))
    return bound, int(bits[0]) & mask


def entries_at_or_above_reference(flat: torch.Tensor, bound: torch.Tensor,
                                  index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the entries of 1-D ``flat`` with ``|x| >= bound`` (NaN never), by
    ``torch.nonzero`` on ``flat``'s device."""
    positions = torch.nonzero(flat.abs() >= bound.to(flat.device)).reshape(-1)
    return flat.index_select(0, positions), positions.to(index_dtype)


def entries_at_or_above(flat: torch.Tensor, threshold: float,
                        index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)``: the entries of the 1-D ``flat`` with magnitude ``>= threshold`` (exactly
    in ``flat``'s dtype, NaN never) and their increasing positions as ``index_dtype``: what
    ``i = torch.nonzero(flat.abs() >= threshold)`` and ``flat[i]`` give. The compiled pass on a CPU
    from :data:`~grace_legacy.compressors.kernels.selection.SMALL` entries, else the reference."""
    bound, bound_bits = magnitude_bound(threshold, flat.dtype)
    if not paths.cpu_path(flat) or flat.numel() < SMALL:
        return entries_at_or_above_reference(flat, bound, index_dtype)
    bits, mask = magnitude_bits(flat)
    # NaN's patterns sort above infinity's, so the upper end of the range leaves them out.
    kept, positions = entries_in_range(bits.numpy(), mask, bound_bits, INFINITY_BITS[flat.dtype],
                                       _NUMPY_INDEX[index_dtype])
    if not positions.size:  # numpy's empty array can carry a zero stride, which torch cannot view
        return flat.new_empty(0), torch.empty(0, dtype=index_dtype)
    return torch.from_numpy(kept).view(flat.dtype), torch.from_numpy(positions)


def entries_in_range(bits: np.ndarray, mask: int, lower: int, upper: int,
                     index_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(entries, positions)``: the entries ``bits[i]`` (unmasked, so a float's sign survives a
    view back) with ``lower <= bits[i] & mask <= upper``, and their increasing positions as
    ``index_dtype``, which must hold ``bits.size - 1``. By the compiled loops."""
    threads = compiled.threads_for(bits.size)
    if threads == 1 and _looks_sparse(bits, mask, lower, upper):
        # Few entries, by the sampled positions Top-k estimates from: counted first (a vectorized
        # read), then only the sub-blocks that hold one are read again, into outputs of the exact size.
        found = _count_in_range(bits, mask, lower, upper, 0, bits.size)
        positions, kept = compiled.empty(found, index_dtype), compiled.empty(found, bits.dtype)
        _write_in_range_sparse(bits, mask, lower, upper, positions, kept, 0, 0, bits.size)
        return kept, positions
    if threads == 1:
        # Every entry is written at the next free slot whatever the test says, so both outputs are
        # bits.size long; untouched pages cost nothing, and a small result is copied out.
        positions = compiled.empty(bits.size, index_dtype)
        kept = compiled.empty(bits.size, bits.dtype)
        found = _in_range(bits, mask, lower, upper, positions, kept)
        if 2 * found < bits.size:
            return compiled.copy(kept[:found]), compiled.copy(positions[:found])
        return kept[:found], positions[:found]
    # On several threads: each block's entries counted first (a vectorized read), then written at
    # the block's offset in outputs of the exact size; no copy afterwards, whatever the fraction kept.
    counts = np.empty(compiled.blocks(bits.size), dtype=np.int64)
    with compiled.launched(threads):
        _count_in_range_parallel(bits, mask, lower, upper, counts)
        offsets = np.cumsum(counts) - counts
        found = int(counts.sum())
        positions, kept = compiled.empty(found, index_dtype), compiled.empty(found, bits.dtype)
        # Few entries: only the sub-blocks that hold one are read twice (the rule of the candidates).
        sparse = found * SPARSE_BLOCKS < bits.size
        _write_in_range_parallel(bits, mask, lower, upper, positions, kept, offsets, counts, sparse)
    return kept, positions


def _looks_sparse(bits: np.ndarray, mask: int, lower: int, upper: int) -> bool:
    """Whether fewer than one entry in :data:`SPARSE_BLOCKS` looks to be in the range, by the entries
    at Top-k's sampled positions (only the pass's speed depends on the answer)."""
    if bits.size < SAMPLES:
        return False
    sampled = sampled_magnitudes(bits, mask)
    hits = np.count_nonzero((sampled >= lower) & (sampled <= upper))
    return hits * SPARSE_BLOCKS < SAMPLES


@compiled.loop
def _in_range(bits, mask, lower, upper, positions, kept):  # pragma: no cover - compiled
    # No branch on the test: every entry is written at the next free slot, which advances by 0 or 1
    # (a branch taken at random is mispredicted half the time).
    found = 0
    for i in range(bits.size):
        entry = bits[i]
        magnitude = entry & mask
        positions[found] = i
        kept[found] = entry
        found += (magnitude >= lower) & (magnitude <= upper)
    return found


# Each block pass loops over a slice of its range from 0 and writes into its outputs sliced from
# its first slot, counting those from 0 too (compiled.py: why); positions are the slice's plus start.
@compiled.loop
def _count_in_range(bits, mask, lower, upper, start, end):  # pragma: no cover - compiled
    bits = bits[start:end]
    hits = 0
    for i in range(bits.size):  # no branch: vectorized
        magnitude = bits[i] & mask
        hits += (magnitude >= lower) & (magnitude <= upper)
    return hits


@compiled.parallel_loop
def _count_in_range_parallel(bits, mask, lower, upper, counts):  # pragma: no cover - compiled
    n = bits.size
    for b in numba.prange(counts.size):
        counts[b] = _count_in_range(bits, mask, lower, upper, b * BLOCK, min(n, (b + 1) * BLOCK))


@compiled.loop
def _write_in_range(bits, mask, lower, upper, positions, kept, at, limit, start, end):  # pragma: no cover
    # As _in_range, from the block's own offset; it stops once its last entry is written, since
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


@compiled.loop
def _write_hits(bits, mask, lower, upper, positions, kept, found, start, first, last):  # pragma: no cover
    # The entries of bits[first:last] in the range, from slot `found`; the next free slot.
    for i in range(first, last):
        entry = bits[i]
        magnitude = entry & mask
        if (magnitude >= lower) & (magnitude <= upper):
            positions[found] = start + i
            kept[found] = entry
            found += 1
    return found


@compiled.loop
def _write_in_range_sparse(bits, mask, lower, upper, positions, kept, at, start, end):  # pragma: no cover
    # For few entries: each sub-block is counted without a branch, and only those holding an entry
    # are read again to write it.
    bits = bits[start:end]
    positions, kept = positions[at:], kept[at:]
    n = bits.size
    found = 0
    whole = n - n % SUB_BLOCK
    for first in range(0, whole, SUB_BLOCK):
        hits = 0
        for i in range(first, first + SUB_BLOCK):
            magnitude = bits[i] & mask
            hits += (magnitude >= lower) & (magnitude <= upper)
        if hits:
            found = _write_hits(bits, mask, lower, upper, positions, kept, found, start, first, first + SUB_BLOCK)
    _write_hits(bits, mask, lower, upper, positions, kept, found, start, whole, n)


@compiled.parallel_loop
def _write_in_range_parallel(bits, mask, lower, upper, positions, kept, offsets, counts, sparse):  # pragma: no cover
    n = bits.size
    for b in numba.prange(counts.size):
        if not counts[b]:
            continue
        if sparse:
            _write_in_range_sparse(bits, mask, lower, upper, positions, kept, offsets[b], b * BLOCK,
                                   min(n, (b + 1) * BLOCK))
        else:
            _write_in_range(bits, mask, lower, upper, positions, kept, offsets[b], offsets[b] + counts[b],
                            b * BLOCK, min(n, (b + 1) * BLOCK))
