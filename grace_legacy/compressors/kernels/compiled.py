"""What the compiled CPU loops share: one switch, and one way to compile them.

The loops in :mod:`~grace_legacy.compressors.kernels.scan`, :mod:`~grace_legacy.compressors.kernels.sign_passes`
and :mod:`~grace_legacy.compressors.kernels.stochastic` are numba functions. Each module builds them in
its own ``_kernels()`` on first use, so importing grace_legacy never imports numba; compiled code
is cached on disk beside the module (``__pycache__``), so a later process loads it instead of
compiling again.

:data:`ENABLED` lets tests hold the quantizers and 1-bit compressors to the tensor arithmetic
that other devices run, on a CPU too; the formula tests run both ways and compare bit for bit.
Top-k's selection has no such switch: its torch path (for other devices) is tested directly.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

#: Whether the compiled loops run where they can; tests clear it to take the tensor path on CPU.
ENABLED = True


def applies(tensor: torch.Tensor, dtypes: Collection[torch.dtype] | None = None) -> bool:
    """Whether the compiled loops handle ``tensor``: a CPU tensor while :data:`ENABLED`, of one of
    ``dtypes`` when they are given."""
    return ENABLED and tensor.device.type == "cpu" and (dtypes is None or tensor.dtype in dtypes)


def loop():
    """The decorator that compiles a loop: no Python objects (``njit``), the GIL released (Horovod's
    threads run meanwhile), cached on disk, and no bounds checks (each loop's indices are checked by
    its caller's sizes). Imports numba, so call it inside a ``_kernels()``."""
    import numba

    return numba.njit(nogil=True, cache=True, boundscheck=False)
