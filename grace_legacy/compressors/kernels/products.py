"""Compiled CPU passes of PowerSGD's three matrix products, in an order fixed by the shapes alone.

PowerSGD multiplies the gradient matrix ``M`` (n x m) by thin factors (r columns, r small):
``P = M Q``, ``Q' = M^T P^`` and, decoding, ``P^ Q'^T``. A BLAS (MKL on x86 CPUs) splits such
products among its threads in ways that change the order of the additions, so their last bits
change with ``torch.get_num_threads()`` (measured: ``P^T M`` of a 1100 x 1001 matrix, ``P Q^T``
of a 10 x 100,000 one). These loops give every output element one fixed order of additions and
share the outputs, never a sum, among threads, so each product is the same whatever the thread
count:

* ``M Q``: each element ``P[i, k]`` is the dot product of row ``i`` of ``M`` and column ``k`` of
  ``Q`` (given as the rows of ``Q^T``), summed in eight interleaved partial sums (positions
  modulo 8, the last ``m % 8`` into the first) added as ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) +
  (s6 + s7))``; threads take rows;
* ``P^T M`` (which is ``Q'^T``): ``out[k, j] = sum_i P[i, k] M[i, j]``, over ``i`` in order, a
  product then a sum for each term; threads take blocks of columns;
* ``P Q^T``: ``out[i, j] = sum_k P[i, k] Q[j, k]``, over ``k`` in order; threads take rows.

Float32 and float64, in the matrix's own dtype, as a BLAS computes them. Other devices keep
torch's products (one device, one library: the same results every run there).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled as _compiled

COMPILED_DTYPES = (torch.float32, torch.float64)
#: Columns of ``M`` per block of ``P^T M``: r rows of this many accumulators stay in cache.
COLUMNS = 512


def kernels_apply(matrix: torch.Tensor) -> bool:
    """Whether the compiled products handle ``matrix``: a float32 or float64 tensor on the CPU's
    own path (:mod:`grace_legacy.compressors.kernels.compiled`)."""
    return _compiled.applies(matrix, COMPILED_DTYPES)


@functools.cache
def _kernels() -> SimpleNamespace:
    import numba

    compiled = _compiled.loop()
    parallel = _compiled.parallel_loop()
    columns = COLUMNS

    @compiled
    def dot(a, b, zero):  # pragma: no cover - compiled
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
        n = a.size
        whole = n - n % 8
        for j in range(0, whole, 8):
            s0 += a[j] * b[j]
            s1 += a[j + 1] * b[j + 1]
            s2 += a[j + 2] * b[j + 2]
            s3 += a[j + 3] * b[j + 3]
            s4 += a[j + 4] * b[j + 4]
            s5 += a[j + 5] * b[j + 5]
            s6 += a[j + 6] * b[j + 6]
            s7 += a[j + 7] * b[j + 7]
        for j in range(whole, n):
            s0 += a[j] * b[j]
        return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))

    @compiled
    def times_rows(m, qt, out, first, last):  # pragma: no cover - compiled
        zero = m.dtype.type(0)
        for i in range(first, last):
            for k in range(qt.shape[0]):
                out[i, k] = dot(m[i], qt[k], zero)

    @compiled
    def times(m, qt, out):  # pragma: no cover - compiled
        times_rows(m, qt, out, 0, m.shape[0])

    @parallel
    def times_parallel(m, qt, out, rows):  # pragma: no cover - compiled
        n = m.shape[0]
        for b in numba.prange((n + rows - 1) // rows):
            times_rows(m, qt, out, b * rows, min(n, (b + 1) * rows))

    @compiled
    def transposed_columns(p, m, out, first, last):  # pragma: no cover - compiled
        # Into a block of its own, then copied: its rows are contiguous for numba, so the inner
        # loop vectorizes (a view of out's columns is strided, and made it five times slower).
        block = np.zeros((p.shape[1], last - first), m.dtype)
        for i in range(m.shape[0]):
            row = m[i, first:last]
            for k in range(p.shape[1]):
                weight = p[i, k]
                accumulated = block[k]
                for j in range(last - first):
                    accumulated[j] += weight * row[j]
        out[:, first:last] = block

    @compiled
    def transposed(p, m, out):  # pragma: no cover - compiled
        for first in range(0, m.shape[1], columns):
            transposed_columns(p, m, out, first, min(m.shape[1], first + columns))

    @parallel
    def transposed_parallel(p, m, out):  # pragma: no cover - compiled
        width = m.shape[1]
        for b in numba.prange((width + columns - 1) // columns):
            transposed_columns(p, m, out, b * columns, min(width, (b + 1) * columns))

    @compiled
    def outer_rows(p, qt, out, first, last):  # pragma: no cover - compiled
        for i in range(first, last):
            row = out[i]
            weight = p[i, 0]
            for j in range(row.size):
                row[j] = weight * qt[0, j]
            for k in range(1, p.shape[1]):
                weight = p[i, k]
                for j in range(row.size):
                    row[j] += weight * qt[k, j]

    @compiled
    def outer(p, qt, out):  # pragma: no cover - compiled
        outer_rows(p, qt, out, 0, p.shape[0])

    @parallel
    def outer_parallel(p, qt, out, rows):  # pragma: no cover - compiled
        n = p.shape[0]
        for b in numba.prange((n + rows - 1) // rows):
            outer_rows(p, qt, out, b * rows, min(n, (b + 1) * rows))

    return SimpleNamespace(times=times, times_parallel=times_parallel, transposed=transposed,
                           transposed_parallel=transposed_parallel, outer=outer, outer_parallel=outer_parallel)


def _rows_per_block(width: int) -> int:
    """Rows that make about one block of :data:`~grace_legacy.compressors.kernels.compiled.BLOCK` elements."""
    return max(1, _compiled.BLOCK // max(width, 1))


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().numpy()


def matrix_times(matrix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``matrix @ q`` (n x m times m x r) in the fixed order of the module docstring."""
    m, qt = _array(matrix), np.ascontiguousarray(_array(q).T)
    out = np.empty((m.shape[0], qt.shape[0]), dtype=m.dtype)
    kernels = _kernels()
    _compiled.run(kernels.times, lambda *a: kernels.times_parallel(*a, _rows_per_block(m.shape[1])), m.size,
                  m, qt, out)
    return torch.from_numpy(out)


def transposed_times(p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``p.t() @ matrix`` (r x n times n x m) in the fixed order of the module docstring."""
    pa, m = _array(p), _array(matrix)
    out = np.empty((pa.shape[1], m.shape[1]), dtype=m.dtype)
    kernels = _kernels()
    _compiled.run(kernels.transposed, kernels.transposed_parallel, m.size, pa, m, out)
    return torch.from_numpy(out)


def times_transposed(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p @ q.t()`` (n x r times r x m) in the fixed order of the module docstring; into ``out``
    (a contiguous n x m CPU tensor of ``p``'s dtype) when given."""
    pa, qt = _array(p), np.ascontiguousarray(_array(q).T)
    if out is None:
        out = torch.empty((pa.shape[0], qt.shape[1]), dtype=p.dtype)
    elif out.shape != (pa.shape[0], qt.shape[1]) or out.dtype != p.dtype or not out.is_contiguous():
        raise ValueError(f"times_transposed: out must be a contiguous {pa.shape[0]} x {qt.shape[1]} {p.dtype} "
                         f"tensor, got {tuple(out.shape)} {out.dtype}")
    kernels = _kernels()
    _compiled.run(kernels.outer, lambda *a: kernels.outer_parallel(*a, _rows_per_block(qt.shape[1])), out.numel(),
                  pa, qt, out.numpy())
    return out
