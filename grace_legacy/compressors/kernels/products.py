"""PowerSGD's three matrix products, on a CPU in an order fixed by the shapes alone.

PowerSGD multiplies the gradient matrix ``M`` (n x m) by thin factors (r columns, r small):
``P = M Q``, ``Q' = M^T P^`` and, decoding, ``P^ Q'^T``. A BLAS (MKL on x86 CPUs) splits such
products among its threads in ways that change the order of the additions, so their last bits
change with ``torch.get_num_threads()`` (measured: ``P^T M`` of a 1100 x 1001 matrix, ``P Q^T``
of a 10 x 100,000 one). These loops give every output element one fixed order of additions and
share the outputs, never a sum, among threads, so each product is the same whatever the thread
count:

* ``M Q``: each element ``P[i, k]`` is the dot product of row ``i`` of ``M`` and column ``k`` of
  ``Q`` (given as the rows of ``Q^T``), summed in :data:`LANES` interleaved partial sums (position
  ``j`` into sum ``j % LANES``, in order), which are then folded in halves: sum ``l`` plus sum
  ``l + LANES / 2``, and so on down to one; threads take rows. Sums that are whole vectors are
  what lets the compiler vectorize the loop without reordering a single addition;
* ``P^T M`` (which is ``Q'^T``): ``out[k, j] = sum_i P[i, k] M[i, j]``, over ``i`` in order, a
  product then a sum for each term; threads take blocks of columns;
* ``P Q^T``: ``out[i, j] = sum_k P[i, k] Q[j, k]``, over ``k`` in order; threads take rows.
  Error feedback's ``M - P Q^T`` subtracts that sum from ``M[i, j]`` in the same loop, the bits
  of the product followed by the subtraction.

Float32 and float64, in the matrix's own dtype, as a BLAS computes them. Other devices, and
other dtypes, keep torch's products (one device, one library: the same results every run there),
the reference each function below falls back to.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled

COMPILED_DTYPES = (torch.float32, torch.float64)
#: Columns of ``M`` per block of ``P^T M``: r rows of this many accumulators stay in cache.
COLUMNS = 512
#: Interleaved partial sums of each element of ``M Q``: several SIMD registers' worth.
LANES = 64


def _compiled_for(matrix: torch.Tensor) -> bool:
    return compiled.applies(matrix, COMPILED_DTYPES)


def _rows_per_block(width: int) -> int:
    """Rows that make about one block of :data:`~grace_legacy.compressors.kernels.compiled.BLOCK` elements."""
    return max(1, compiled.BLOCK // max(width, 1))


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().contiguous().numpy()


def matrix_times(matrix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``matrix @ q`` (n x m times m x r): on a CPU in the fixed order of the module docstring."""
    if not _compiled_for(matrix):
        return matrix @ q
    m, qt = _array(matrix), np.ascontiguousarray(_array(q).T)
    out = np.empty((m.shape[0], qt.shape[0]), dtype=m.dtype)
    rows = _rows_per_block(m.shape[1])
    compiled.run(_times, lambda *a: _times_parallel(*a, rows), m.size, m, qt, out)
    return torch.from_numpy(out)


def transposed_times(p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``p.t() @ matrix`` (r x n times n x m): on a CPU in the fixed order of the module docstring."""
    if not _compiled_for(matrix):
        return p.t() @ matrix
    pa, m = _array(p), _array(matrix)
    out = np.empty((pa.shape[1], m.shape[1]), dtype=m.dtype)
    compiled.run(_transposed, _transposed_parallel, m.size, pa, m, out)
    return torch.from_numpy(out)


def times_transposed(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p @ q.t()`` (n x r times r x m): on a CPU in the fixed order of the module docstring; into
    ``out`` (a contiguous n x m tensor of ``p``'s dtype on ``p``'s device) when given."""
    n, m = p.shape[0], q.shape[0]
    if out is not None and (out.shape != (n, m) or out.dtype != p.dtype or not out.is_contiguous()
                            or out.device != p.device):
        raise ValueError(f"times_transposed: out must be a contiguous {n} x {m} {p.dtype} tensor on {p.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    if not _compiled_for(q):
        return p @ q.t() if out is None else torch.mm(p, q.t(), out=out)
    pa, qt = _array(p), np.ascontiguousarray(_array(q).T)
    if out is None:
        out = torch.empty((n, m), dtype=p.dtype)
    rows = _rows_per_block(m)
    compiled.run(_outer, lambda *a: _outer_parallel(*a, rows), out.numel(), pa, qt, out.numpy())
    return out


def minus_times_transposed(matrix: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """``matrix - p @ q.t()`` (n x m less n x r times r x m), bit for bit :func:`times_transposed`
    then the subtraction, without the product's n x m tensor; into ``out`` (a contiguous n x m
    tensor of ``matrix``'s dtype) when given. PowerSGD's residual: one pass instead of two."""
    n, m = p.shape[0], q.shape[0]
    if matrix.shape != (n, m) or matrix.dtype != p.dtype:
        raise ValueError(f"minus_times_transposed: matrix must be {n} x {m} {p.dtype}, got "
                         f"{tuple(matrix.shape)} {matrix.dtype}")
    if out is not None and (out.shape != (n, m) or out.dtype != p.dtype or not out.is_contiguous()
                            or out.device != p.device):
        raise ValueError(f"minus_times_transposed: out must be a contiguous {n} x {m} {p.dtype} tensor on "
                         f"{p.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    if not (_compiled_for(q) and _compiled_for(matrix)):
        return torch.sub(matrix, p @ q.t()) if out is None else torch.sub(matrix, p @ q.t(), out=out)
    pa, qt, ma = _array(p), np.ascontiguousarray(_array(q).T), _array(matrix)
    if out is None:
        out = torch.empty((n, m), dtype=p.dtype)
    rows = _rows_per_block(m)
    compiled.run(_minus_outer, lambda *a: _minus_outer_parallel(*a, rows), out.numel(), ma, pa, qt, out.numpy())
    return out


@compiled.loop
def _times_rows(m, qt, out, first, last):  # pragma: no cover - compiled
    width = m.shape[1]
    whole = width - width % LANES
    sums = np.empty(LANES, m.dtype)
    for i in range(first, last):
        row = m[i]
        for k in range(qt.shape[0]):
            column = qt[k]
            sums[:] = 0
            for start in range(0, whole, LANES):
                for lane in range(LANES):
                    sums[lane] += row[start + lane] * column[start + lane]
            for lane in range(width - whole):
                sums[lane] += row[whole + lane] * column[whole + lane]
            half = LANES // 2
            while half > 0:
                for lane in range(half):
                    sums[lane] += sums[lane + half]
                half //= 2
            out[i, k] = sums[0]


@compiled.loop
def _times(m, qt, out):  # pragma: no cover - compiled
    _times_rows(m, qt, out, 0, m.shape[0])


@compiled.parallel_loop
def _times_parallel(m, qt, out, rows):  # pragma: no cover - compiled
    n = m.shape[0]
    for b in numba.prange((n + rows - 1) // rows):
        _times_rows(m, qt, out, b * rows, min(n, (b + 1) * rows))


@compiled.loop
def _transposed_columns(p, m, out, first, last):  # pragma: no cover - compiled
    # Into a block of its own, then copied: its rows are contiguous for numba, so the inner
    # loop vectorizes (a view of out's columns is strided, and made it five times slower). Four
    # rows of M a pass, so that the block is read and written a quarter as often: each element
    # still adds its terms one by one in i's order.
    width, n = last - first, m.shape[0]
    block = np.zeros((p.shape[1], width), m.dtype)
    fours = n - n % 4
    for i in range(0, fours, 4):
        row0, row1, row2, row3 = m[i, first:last], m[i + 1, first:last], m[i + 2, first:last], m[i + 3, first:last]
        for k in range(p.shape[1]):
            w0, w1, w2, w3 = p[i, k], p[i + 1, k], p[i + 2, k], p[i + 3, k]
            accumulated = block[k]
            for j in range(width):
                accumulated[j] = (((accumulated[j] + w0 * row0[j]) + w1 * row1[j]) + w2 * row2[j]) + w3 * row3[j]
    for i in range(fours, n):
        row = m[i, first:last]
        for k in range(p.shape[1]):
            weight = p[i, k]
            accumulated = block[k]
            for j in range(width):
                accumulated[j] += weight * row[j]
    out[:, first:last] = block


@compiled.loop
def _transposed(p, m, out):  # pragma: no cover - compiled
    for first in range(0, m.shape[1], COLUMNS):
        _transposed_columns(p, m, out, first, min(m.shape[1], first + COLUMNS))


@compiled.parallel_loop
def _transposed_parallel(p, m, out):  # pragma: no cover - compiled
    width = m.shape[1]
    for b in numba.prange((width + COLUMNS - 1) // COLUMNS):
        _transposed_columns(p, m, out, b * COLUMNS, min(width, (b + 1) * COLUMNS))


@compiled.inline
def _outer_row(p, qt, i, row):  # pragma: no cover - compiled
    # Two terms of the sum a pass, so that the row is read and written half as often: each
    # element still adds its products one by one in k's order.
    r = p.shape[1]
    weight = p[i, 0]
    if r == 1:
        for j in range(row.size):
            row[j] = weight * qt[0, j]
        return
    second = p[i, 1]
    for j in range(row.size):
        row[j] = weight * qt[0, j] + second * qt[1, j]
    for k in range(2, r - 1, 2):
        weight, second = p[i, k], p[i, k + 1]
        for j in range(row.size):
            row[j] = (row[j] + weight * qt[k, j]) + second * qt[k + 1, j]
    if r % 2 == 1:
        weight = p[i, r - 1]
        for j in range(row.size):
            row[j] += weight * qt[r - 1, j]


@compiled.loop
def _outer_rows(p, qt, out, first, last):  # pragma: no cover - compiled
    for i in range(first, last):
        _outer_row(p, qt, i, out[i])


@compiled.loop
def _outer(p, qt, out):  # pragma: no cover - compiled
    _outer_rows(p, qt, out, 0, p.shape[0])


@compiled.parallel_loop
def _outer_parallel(p, qt, out, rows):  # pragma: no cover - compiled
    n = p.shape[0]
    for b in numba.prange((n + rows - 1) // rows):
        _outer_rows(p, qt, out, b * rows, min(n, (b + 1) * rows))


@compiled.loop
def _minus_outer_rows(m, p, qt, out, first, last):  # pragma: no cover - compiled
    r = p.shape[1]
    for i in range(first, last):
        row, minuend = out[i], m[i]
        if r <= 2:  # _outer_row's one pass, each sum subtracted before it is stored
            weight, q0 = p[i, 0], qt[0]
            if r == 1:
                for j in range(row.size):
                    row[j] = minuend[j] - weight * q0[j]
            else:
                second, q1 = p[i, 1], qt[1]
                for j in range(row.size):
                    row[j] = minuend[j] - (weight * q0[j] + second * q1[j])
            continue
        _outer_row(p, qt, i, row)  # the row stays in cache for the subtraction
        for j in range(row.size):
            row[j] = minuend[j] - row[j]


@compiled.loop
def _minus_outer(m, p, qt, out):  # pragma: no cover - compiled
    _minus_outer_rows(m, p, qt, out, 0, p.shape[0])


@compiled.parallel_loop
def _minus_outer_parallel(m, p, qt, out, rows):  # pragma: no cover - compiled
    n = p.shape[0]
    for b in numba.prange((n + rows - 1) // rows):
        _minus_outer_rows(m, p, qt, out, b * rows, min(n, (b + 1) * rows))
