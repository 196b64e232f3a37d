"""A sparse decode's pass: each value written at its flat index, ``out[indices[i]] = values[i]``
(docs/DESIGN.md#sparse-sums). The reference is torch's ``scatter_``, which every device other
than the CPU runs. On a CPU ``scatter_`` widens int32 indices as it goes and takes several times
longer on them than on int64 ones, and widening them first costs a pass and an int64 copy as large
as the payload; a loop compiled by numba reads int32 or int64 indices as they came, and
:func:`put` picks it where it applies.

Blocks of indices run on several threads (:mod:`~grace_legacy.compressors.kernels.compiled`)
only where no two blocks can write one element: each block reports whether its indices strictly
increase, and the blocks' ranges must follow each other. Otherwise (a repeated index, indices out
of order, as from a foreign payload) the pass is redone on one thread in index order, the last
value written winning, so the result never depends on the thread count.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled

BLOCK = compiled.BLOCK
VALUE_DTYPES = (torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
#: ``scatter_``/``scatter_add_`` take int32 indices from torch 2.8 on; before, they are widened.
_SCATTER_TAKES_INT32 = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def scatter_indices(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` as ``scatter_`` accepts them (widened to int64 only where it must)."""
    return indices if _SCATTER_TAKES_INT32 or indices.dtype == torch.int64 else indices.long()


def applies(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the compiled loop handles these tensors: a contiguous 1-D float32 or float64 ``out``
    on the CPU's own path, 1-D int32 or int64 ``indices`` and as many ``values`` of ``out``'s dtype there."""
    return (compiled.applies(out, VALUE_DTYPES) and out.dim() == 1 and out.is_contiguous()
            and indices.dtype in INDEX_DTYPES and indices.dim() == 1 and indices.device == out.device
            and values.dtype == out.dtype and values.shape == indices.shape and values.device == out.device)


def put(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out[indices[i]] = values[i]`` for every ``i`` (1-D ``out``, as many ``values`` as
    ``indices``): the compiled loop where it :func:`applies`, the last value winning where an index
    repeats, and a ``ValueError`` naming the count where an index lies outside ``out``; else
    ``out.scatter_``."""
    if not applies(out, indices, values):
        out.scatter_(0, scatter_indices(indices), values)
        return
    arrays = (out.numpy(), indices.contiguous().numpy(), values.contiguous().numpy())
    outside, disjoint = compiled.run(_put, _put_parallel, indices.numel(), *arrays)
    if not disjoint:  # two blocks may have written one element: redo it in index order
        outside, _ = _put(*arrays)
    if outside:
        raise ValueError(f"a sparse payload has {outside} index(es) outside a tensor of {out.numel()} elements "
                         f"(indices must lie in [0, {out.numel()}))")


@compiled.loop
def _put_range(out, indices, values, start, end):  # pragma: no cover - compiled
    # Returns how many indices fell outside ``out`` (not written) and whether the range's
    # indices strictly increase.
    indices, values = indices[start:end], values[start:end]
    n, outside, increasing = out.size, 0, True
    previous = -1
    for i in range(end - start):
        j = indices[i]
        if j < 0 or j >= n:
            outside += 1
            continue
        out[j] = values[i]
        increasing &= j > previous
        previous = j
    return outside, increasing


@compiled.loop
def _put(out, indices, values):  # pragma: no cover - compiled
    # One thread writes in index order: its result is the one to have, whatever the order.
    return _put_range(out, indices, values, 0, indices.size)[0], True


@compiled.parallel_loop
def _put_parallel(out, indices, values):  # pragma: no cover - compiled
    blocks = (indices.size + BLOCK - 1) // BLOCK
    outside, increasing = np.zeros(blocks, np.int64), np.zeros(blocks, np.bool_)
    for b in numba.prange(blocks):
        outside[b], increasing[b] = _put_range(out, indices, values, b * BLOCK, min(indices.size, (b + 1) * BLOCK))
    apart = True
    for b in range(1, blocks):
        apart &= indices[b * BLOCK - 1] < indices[b * BLOCK]
    return outside.sum(), increasing.all() and apart
