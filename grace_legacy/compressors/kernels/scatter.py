"""The compiled CPU pass of a sparse decode: each value written at its flat index
(docs/DESIGN.md#sparse-sums). torch's ``scatter_`` widens int32 indices as it goes and takes
several times longer on them than on int64 ones, and widening them first costs a pass and an
int64 copy as large as the payload; this loop reads int32 or int64 indices as they came.

Blocks of indices run on several threads (:mod:`~grace_legacy.compressors.kernels.compiled`)
only where no two blocks can write one element: each block reports whether its indices strictly
increase, and the blocks' ranges must follow each other. Otherwise (a repeated index, indices out
of order, as from a foreign payload) the pass is redone on one thread in index order, the last
value written winning, so the result never depends on the thread count.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled as _compiled

VALUE_DTYPES = (torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


@functools.cache
def _kernels() -> SimpleNamespace:
    import numba

    compiled = _compiled.loop()
    parallel = _compiled.parallel_loop()
    block = _compiled.BLOCK

    @compiled
    def put_range(out, indices, values, start, end):  # pragma: no cover - compiled
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

    @compiled
    def put(out, indices, values):  # pragma: no cover - compiled
        # One thread writes in index order: its result is the one to have, whatever the order.
        return put_range(out, indices, values, 0, indices.size)[0], True

    @parallel
    def put_parallel(out, indices, values):  # pragma: no cover - compiled
        blocks = (indices.size + block - 1) // block
        outside, increasing = np.zeros(blocks, np.int64), np.zeros(blocks, np.bool_)
        for b in numba.prange(blocks):
            outside[b], increasing[b] = put_range(out, indices, values, b * block, min(indices.size, (b + 1) * block))
        apart = True
        for b in range(1, blocks):
            apart &= indices[b * block - 1] < indices[b * block]
        return outside.sum(), increasing.all() and apart

    return SimpleNamespace(put=put, put_parallel=put_parallel)


def applies(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether :func:`put` handles these tensors: a contiguous 1-D float32 or float64 ``out`` on the
    CPU's own path, 1-D int32 or int64 ``indices`` and as many ``values`` of ``out``'s dtype there."""
    return (_compiled.applies(out, VALUE_DTYPES) and out.dim() == 1 and out.is_contiguous()
            and indices.dtype in INDEX_DTYPES and indices.dim() == 1 and indices.device == out.device
            and values.dtype == out.dtype and values.shape == indices.shape and values.device == out.device)


def put(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out[indices[i]] = values[i]`` for every ``i`` (see :func:`applies`), the last value winning
    where an index repeats; ``ValueError`` naming the count where an index lies outside ``out``."""
    kernels = _kernels()
    arrays = (out.numpy(), indices.contiguous().numpy(), values.contiguous().numpy())
    outside, disjoint = _compiled.run(kernels.put, kernels.put_parallel, indices.numel(), *arrays)
    if not disjoint:  # two blocks may have written one element: redo it in index order
        outside, _ = kernels.put(*arrays)
    if outside:
        raise ValueError(f"a sparse payload has {outside} index(es) outside a tensor of {out.numel()} elements "
                         f"(indices must lie in [0, {out.numel()}))")
