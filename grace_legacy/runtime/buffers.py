"""Output buffers used again across steps, but only once nothing outside grace_legacy refers to them
(why: docs/DESIGN.md#kept-buffers).

The promise: a buffer handed out is the caller's for as long as the caller keeps anything that
refers to its memory (the tensor, a view or a ``.grad`` set to it, a numpy array or ``memoryview``
of it, its ``UntypedStorage``); only then is it zeroed and handed out again, otherwise a new one
replaces it. Only buffers on the CPU's own path (:mod:`grace_legacy.runtime.paths`) are kept.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Hashable

import torch

from grace_legacy.runtime import paths

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


@functools.cache
def _c_memset() -> Callable[[int, int, int], int] | None:
    """The C library's ``memset`` from the process's own symbols (nothing loaded), or ``None``."""
    try:
        memset = ctypes.CDLL(None).memset
    except (OSError, AttributeError, TypeError):
        return None
    memset.restype = ctypes.c_void_p
    memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    return memset


def zeroed(buffer: torch.Tensor) -> torch.Tensor:
    """A kept (contiguous CPU) ``buffer`` set to ``+0`` (all-zero bits in every float format), by the
    C library's ``memset`` where there is one."""
    memset = _c_memset()
    if memset is None:
        return buffer.zero_()
    memset(buffer.data_ptr(), 0, buffer.numel() * buffer.element_size())
    return buffer


#: Buffers at least this large are worth keeping per size: a fresh one is often a new mapping
#: (glibc's mmap threshold moves between 128 KiB and 32 MiB) or pages just returned to the kernel.
LARGE = 4 * 1024 * 1024
#: Buffers kept per key: a step's result is often still held while the next step's is made (the
#: residual a skipped step would restore, a result the caller has not yet copied), so two turns
#: let every other step write where the one before the last did.
DEPTH = 2
#: glibc's largest mmap threshold on 64-bit: a buffer above it is always a new mapping.
MMAP_CEILING = 32 * 1024 * 1024


def _references(buffer: torch.Tensor) -> tuple[int, int] | None:
    """(references to ``buffer``'s storage object, the storage's use count), or ``None`` where this
    torch cannot tell (then nothing is reused)."""
    if _storage_use_count is None:
        return None
    storage = buffer.untyped_storage()
    return sys.getrefcount(storage), _storage_use_count(storage._cdata)


class BufferPool:
    """Up to :data:`DEPTH` kept CPU buffers per key, each handed out again when nobody else holds
    it; buffers under ``min_bytes`` are always made afresh."""

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes
        # key -> [(buffer, its references when only this pool held it)], the most recently made last
        self._kept: dict[Hashable, list[tuple[torch.Tensor, tuple[int, int] | None]]] = {}

    def zeros(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D zero tensor of ``numel`` elements: one kept under ``key`` if nothing outside this
        pool refers to it any more, else a new one, kept from now on."""
        return self._take(key, numel, dtype, device, torch.zeros, zeroed)

    def empty(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """As :meth:`zeros`, for a caller that overwrites every element: the contents are undefined."""
        return self._take(key, numel, dtype, device, torch.empty, None)

    def _take(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device,
              make: Callable[..., torch.Tensor], clear: Callable[[torch.Tensor], torch.Tensor] | None,
              ) -> torch.Tensor:
        if numel * dtype.itemsize < self.min_bytes:
            return make(numel, dtype=dtype, device=device)
        kept = [entry for entry in self._kept.get(key, ()) if entry[0].numel() == numel
                and entry[0].dtype == dtype and entry[0].device == device]
        for buffer, alone in kept:
            if alone is not None and _references(buffer) == alone:
                return buffer if clear is None else clear(buffer)
        buffer = make(numel, dtype=dtype, device=device)
        if paths.cpu_path(buffer):
            self._kept[key] = [*kept[1 - DEPTH:], (buffer, _references(buffer))]
        else:
            self._kept.pop(key, None)
        return buffer

    def clear(self) -> None:
        """Let go of every kept buffer (their memory is freed once the caller's references go)."""
        self._kept.clear()
