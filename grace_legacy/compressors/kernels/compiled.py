"""What the compiled CPU loops share: one switch and one way to compile them. Each kernel module
builds its numba loops in its own ``_kernels()`` on first use, cached on disk
(docs/DESIGN.md#compiled-passes). Top-k's selection has no switch: its torch path is tested directly.
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
    """The decorator that compiles a loop (``njit``, GIL released, cached, no bounds checks: the
    callers check sizes). Imports numba, so call it inside a ``_kernels()``."""
    import numba

    return numba.njit(nogil=True, cache=True, boundscheck=False)
