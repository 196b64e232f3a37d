"""Compile every loop of this package ahead of a job, into numba's disk cache.

A loop compiles on its first call in a process, for each new set of argument types, and is then
cached on disk (:func:`grace_legacy.compressors.kernels.compiled.loop`). The ranks of a job started
on a machine whose cache is empty all reach their first step together, and each compiles the same
loops itself: every rank pays the compile time on its own, on cores that the ranks share. Warming
the cache once first leaves them only the load::

    python -m grace_legacy.compressors.kernels.warm [float32] [float64]

``make test`` does it before its suites start many processes at once, one process per dtype. Each
pass runs on the dtypes named (default: both floating dtypes the loops take), serially and on two
threads (the parallel variant of each loop).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from grace_legacy.compressors.kernels import (
    accumulating,
    compiled,
    natural_passes,
    products,
    qsgd_passes,
    scatter,
    selection,
    sign_passes,
    terngrad_passes,
    threshold_passes,
    u8bit_passes,
)

#: The dtypes the compiled loops take (half precisions are converted before a pass, or go the tensor way).
DTYPES = (torch.float32, torch.float64)


def every_pass(dtype: torch.dtype = torch.float32) -> None:
    """Each module's passes once on ``dtype``, serially (one thread) and in parallel (two threads:
    every element gets a share of its own, so that the parallel variant runs on any size)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(selection.SMALL + 1001, generator=generator, dtype=torch.float64).to(dtype)
    matrix = torch.randn(300, 200, generator=generator, dtype=torch.float64).to(dtype)
    before = (torch.get_num_threads(), compiled.PER_THREAD)
    compiled.PER_THREAD = 1
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            norm = qsgd_passes.norm(x)
            levels = qsgd_passes.levels(x, norm, 16, 7, torch.int8)
            qsgd_passes.decoded(levels, torch.tensor([norm], dtype=dtype), 16, dtype)
            terngrad_passes.spread(x)
            terngrad_passes.digits(x, 2.0, 2.0, 7)
            top, codes = natural_passes.codes(x, 7)
            natural_passes.decoded(top, codes, dtype, dtype)
            sign_passes.side_means(x)
            sign_passes.mean_magnitude(x)
            buffer, packed = sign_passes.momentum_step(x, x, 0.9)
            sign_passes.choose(packed, x.numel(), torch.tensor(1.0, dtype=dtype), torch.tensor(-1.0, dtype=dtype))
            scatter.put(torch.zeros(x.numel(), dtype=dtype), torch.arange(0, x.numel(), 3, dtype=torch.int32),
                        x[::3].clone())
            selection.top_k_indices(x, 100)
            threshold_passes.entries_at_or_above(x, 2.0, torch.int32)
            q = products.matrix_times(matrix, torch.randn(200, 4, generator=generator, dtype=dtype))
            decoded = products.times_transposed(q, products.transposed_times(q, matrix).t())
            products.minus_times_transposed(decoded, q, products.transposed_times(q, matrix).t())
            midpoints = torch.linspace(0.01, 0.99, 127, dtype=dtype)
            codes = u8bit_passes.codes(x, x.abs().amax(), midpoints)
            u8bit_passes.decoded(codes, x.abs().amax(), torch.linspace(0, 1, 128, dtype=dtype))
            flat = x.numpy()
            accumulating.bins_pass(np.zeros_like(flat), flat, 50, np.int32)
            accumulating.variance_pass(np.zeros_like(flat), np.zeros_like(flat), flat, flat * flat, 2.0, 0.999,
                                       np.int32)
    finally:
        torch.set_num_threads(before[0])
        compiled.PER_THREAD = before[1]


def main(argv: list[str]) -> None:
    names = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES}
    unknown = [name for name in argv if name not in names]
    if unknown:
        raise SystemExit(f"warm: dtypes must be among {sorted(names)}, got {unknown}")
    for name in argv or names:
        every_pass(names[name])


if __name__ == "__main__":
    main(sys.argv[1:])
