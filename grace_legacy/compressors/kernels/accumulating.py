"""Compiled CPU passes of the sparsifiers that keep what they did not send (AdaComp's residue, the
variance sparsifier's sums): one pass reads the state and the gradient, decides each entry, writes
the sent entries with their positions and the next state. Float32 and float64 arrays; the float
operations are the tensor formulas' (:mod:`grace_legacy.compressors.adacomp`,
:mod:`grace_legacy.compressors.variance`), in the same order, so both give the same bits.

On several threads a pass goes over fixed blocks (AdaComp's whole bins of about ``compiled.BLOCK``
entries), each writing its entries from its own first position in outputs as long as the tensor;
the blocks' entries are then moved together in block order, so the result is the serial pass's.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled as _compiled

COMPILED_DTYPES = (torch.float32, torch.float64)
#: A payload's index dtypes, as numpy spells them.
NUMPY_INDEX = {torch.int32: np.int32, torch.int64: np.int64}


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether the compiled loops handle these tensors: contiguous float32 or float64 on a CPU, one
    dtype, while ``compiled.ENABLED``."""
    first = tensors[0]
    return all(_compiled.applies(t, COMPILED_DTYPES) and t.is_contiguous() and t.dtype == first.dtype
               for t in tensors)


@_compiled.loop
def _bins_range(residue, grad, bin_size, values, positions, kept, start, end):  # pragma: no cover
    # Entries start .. end - 1, ``start`` a multiple of the bin size. Per bin: the largest
    # |G| = |residue + grad| (NaN if any is), then every entry with |G + grad| >= it is sent and
    # leaves G - G behind (0, or NaN for an infinity), the others G.
    residue, grad, kept = residue[start:end], grad[start:end], kept[start:end]
    values, positions = values[start:], positions[start:]
    n = end - start
    found = 0
    for first in range(0, n, bin_size):
        last = min(n, first + bin_size)
        top = abs(residue[first] + grad[first])
        nan = top != top
        for i in range(first + 1, last):
            a = abs(residue[i] + grad[i])
            if a > top:
                top = a
            elif a != a:
                nan = True
        for i in range(first, last):
            g = residue[i] + grad[i]
            if not nan and abs(g + grad[i]) >= top:
                values[found] = g
                positions[found] = start + i
                found += 1
                kept[i] = g - g
            else:
                kept[i] = g
    return found

@_compiled.loop
def _variance_range(r, v, grad, moment, alpha, ksi, values, positions, kept_r, kept_v, start,
                   end):  # pragma: no cover - compiled
    # r' = r + g, v' = v + m; sent where r'^2 > alpha v' (leaving r' - r', 0 or NaN, and 0),
    # else kept as r' and ksi v'.
    r, v, grad, moment = r[start:end], v[start:end], grad[start:end], moment[start:end]
    kept_r, kept_v = kept_r[start:end], kept_v[start:end]
    values, positions = values[start:], positions[start:]
    found = 0
    for i in range(end - start):
        a = r[i] + grad[i]
        b = v[i] + moment[i]
        if a * a > alpha * b:
            values[found] = a
            positions[found] = start + i
            found += 1
            kept_r[i] = a - a
            kept_v[i] = 0
        else:
            kept_r[i] = a
            kept_v[i] = ksi * b
    return found

@_compiled.parallel_loop
def _bins_parallel(residue, grad, bin_size, values, positions, kept, block, counts):  # pragma: no cover
    n = residue.size
    for b in numba.prange(counts.size):
        counts[b] = _bins_range(residue, grad, bin_size, values, positions, kept, b * block,
                               min(n, (b + 1) * block))

@_compiled.parallel_loop
def _variance_parallel(r, v, grad, moment, alpha, ksi, values, positions, kept_r, kept_v, block,
                      counts):  # pragma: no cover
    n = r.size
    for b in numba.prange(counts.size):
        counts[b] = _variance_range(r, v, grad, moment, alpha, ksi, values, positions, kept_r, kept_v,
                                   b * block, min(n, (b + 1) * block))

@_compiled.loop
def _gather_blocks(values, positions, block, counts, out_values, out_positions):  # pragma: no cover
    at = 0
    for b in range(counts.size):
        for j in range(counts[b]):
            out_values[at] = values[b * block + j]
            out_positions[at] = positions[b * block + j]
            at += 1


def _entries(values: np.ndarray, positions: np.ndarray, found: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``found`` entries, copied out of the tensor-long outputs when they are few."""
    if 2 * found < values.size:
        return _compiled.copy(values[:found]), _compiled.copy(positions[:found])
    return values[:found], positions[:found]


def _blocked(run_blocks, values: np.ndarray, positions: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Run ``run_blocks(block, counts)`` on several threads, then the blocks' entries in order."""
    counts = np.empty(-(-values.size // block), dtype=np.int64)
    with _compiled.launched(_compiled.threads_for(values.size)):
        run_blocks(block, counts)
    total = int(counts.sum())
    out_values, out_positions = _compiled.empty(total, values.dtype), _compiled.empty(total, positions.dtype)
    _gather_blocks(values, positions, block, counts, out_values, out_positions)
    return out_values, out_positions


def bins_pass(residue: np.ndarray, grad: np.ndarray, bin_size: int,
              index_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AdaComp's pass over 1-D arrays of one dtype: ``(values, positions, next residue)``."""
    n = residue.size
    values, positions = _compiled.empty(n, residue.dtype), _compiled.empty(n, index_dtype)
    kept = _compiled.empty(n, residue.dtype)
    if _compiled.threads_for(n) == 1:
        found = _bins_range(residue, grad, bin_size, values, positions, kept, 0, n)
        return (*_entries(values, positions, found), kept)
    block = max(1, _compiled.BLOCK // bin_size) * bin_size
    sent = _blocked(lambda size, counts: _bins_parallel(residue, grad, bin_size, values, positions, kept,
                                                               size, counts), values, positions, block)
    return (*sent, kept)


def variance_pass(r: np.ndarray, v: np.ndarray, grad: np.ndarray, moment: np.ndarray, alpha: float, ksi: float,
                  index_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The variance test's pass over 1-D arrays of one dtype: ``(values, positions, next r, next v)``;
    ``alpha`` and ``ksi`` are rounded to that dtype first, as a tensor formula rounds them."""
    n = r.size
    alpha, ksi = r.dtype.type(alpha), r.dtype.type(ksi)
    values, positions = _compiled.empty(n, r.dtype), _compiled.empty(n, index_dtype)
    kept_r, kept_v = _compiled.empty(n, r.dtype), _compiled.empty(n, r.dtype)
    if _compiled.threads_for(n) == 1:
        found = _variance_range(r, v, grad, moment, alpha, ksi, values, positions, kept_r, kept_v, 0, n)
        return (*_entries(values, positions, found), kept_r, kept_v)
    sent = _blocked(lambda size, counts: _variance_parallel(r, v, grad, moment, alpha, ksi, values, positions,
                                                                   kept_r, kept_v, size, counts),
                    values, positions, _compiled.BLOCK)
    return (*sent, kept_r, kept_v)
