"""Which path a tensor takes: the CPU's own, or the one every other device takes.

grace_legacy runs some work differently on a CPU: the compressors' inner loops compiled by numba
(:mod:`grace_legacy.compressors.kernels`), bit packing through numpy views, and output buffers kept
across steps (:mod:`grace_legacy.runtime.buffers`). On any other device the same results come from
tensor formulas and fresh buffers. Every such choice in the package asks :func:`cpu_path`, and
nothing else, so one switch sends CPU tensors down the device path as well:

* the environment variable ``GRACE_LEGACY_DEVICE_PATH=1`` (read when this module is imported, so
  set it before ``import grace_legacy``; every process of a launch inherits it), or
* :func:`device_path` in the process, as tests do.

The device path on a CPU gives the same results, bit for bit, as the CPU path wherever the
compressors promise it (docs/ARCHITECTURE.md, "Randomness"; ``tests/unit/test_device_path.py``),
so a CPU-only machine tests the code a GPU runs. It is slower on a CPU: only tests and checks
should set it.

What stays keyed on the real device: where a collective must move a tensor (NCCL takes CUDA
tensors only: :mod:`grace_legacy.backends.torch_distributed`) and which devices a future waits
on (:mod:`grace_legacy.ddp`). Those are facts about the tensor, not choices of a path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: The environment variable that sends CPU tensors down the device path ("1", "true", "yes", "on").
ENVIRONMENT = "GRACE_LEGACY_DEVICE_PATH"

_TRUE = {"1", "true", "yes", "on"}


def _from_environment() -> bool:
    value = os.environ.get(ENVIRONMENT, "").strip().lower()
    if value and value not in _TRUE | {"0", "false", "no", "off"}:
        raise ValueError(f"{ENVIRONMENT} must be one of 1, true, yes, on (device path) or 0, false, no, off, "
                         f"got {os.environ[ENVIRONMENT]!r}")
    return value in _TRUE


#: Whether CPU tensors take the device path (see the module docstring).
FORCE_DEVICE_PATH: bool = _from_environment()


def cpu_path(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` takes the CPU's own path: a CPU tensor, unless the device path is forced."""
    return tensor.device.type == "cpu" and not FORCE_DEVICE_PATH


@contextmanager
def device_path(on: bool = True) -> Iterator[None]:
    """Within the block, CPU tensors take the device path (``on=False``: their own path), whatever
    the environment says; the setting before is restored after. Process-wide: not for use while
    other threads compress."""
    global FORCE_DEVICE_PATH
    before = FORCE_DEVICE_PATH
    FORCE_DEVICE_PATH = bool(on)
    try:
        yield
    finally:
        FORCE_DEVICE_PATH = before
