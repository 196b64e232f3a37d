"""Output buffers used again across steps, but only once nothing outside grace_legacy refers to them.

A fused bucket's synchronized gradients are views of one zeroed buffer of the bucket's dense size
(:func:`grace_legacy.core.sparse.scatter_sum_columns`). Made afresh every step, that buffer costs
more than the scatter-add it holds: Horovod's optimizer hands its views to the parameters'
``.grad``, ``zero_grad()`` frees them all together, glibc gives the freed pages back to the kernel
once its heap holds more free memory than its trim threshold, and the next step's buffer takes a
page fault (and the kernel's zeroing) on every 4 KiB page again.

The contract: a synchronized gradient is the caller's for as long as the caller keeps anything
that refers to its memory: the tensor, a view or a ``.grad`` set to it, a numpy array or
``memoryview`` of it, its ``UntypedStorage``. Only a buffer none of those refer to any more is
zeroed and handed out again; otherwise a new one replaces it. torch counts every tensor (view or
not) and every array exported from a storage in the storage's use count, and a Python
``UntypedStorage`` object in its own reference count; both are compared with what they were when
the buffer was made, when grace_legacy alone held it.

Only CPU buffers are kept (on the CPU's own path, :mod:`grace_legacy.core.paths`): on an
accelerator, an operation queued on another stream may still read a buffer that Python no longer
references, and the caching allocator already makes fresh buffers cheap there.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Hashable

import torch

from grace_legacy.core import paths

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


@functools.cache
def _c_memset() -> Callable[[int, int, int], int] | None:
    """The C library's ``memset`` from the process's own symbols (no library search, nothing
    loaded), or ``None`` where there is none to be found that way."""
    try:
        memset = ctypes.CDLL(None).memset
    except (OSError, AttributeError, TypeError):
        return None
    memset.restype = ctypes.c_void_p
    memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    return memset


def zeroed(buffer: torch.Tensor) -> torch.Tensor:
    """A kept (contiguous CPU) ``buffer`` set to zero, by the C library's ``memset`` where there
    is one: on the megabytes a kept buffer holds, glibc's clears faster than torch's ``zero_``,
    which stores vector by vector (``benchmarks/performance/throughput.py``, Top-k's decompress).
    All-zero bits are ``+0`` in every float format."""
    memset = _c_memset()
    if memset is None:
        return buffer.zero_()
    memset(buffer.data_ptr(), 0, buffer.numel() * buffer.element_size())
    return buffer


#: Buffers at least this large are worth keeping per size: a fresh one is often a new mapping
#: (glibc maps anything above its mmap threshold, which moves between 128 KiB and 32 MiB with what
#: the process frees) or heap pages just handed back to the kernel, faulted in page by page.
#: Smaller ones mostly come from the heap warm in cache, just freed; kept ones go cold (measured
#: on ResNet-50's and a Transformer's shapes by ``benchmarks/performance/throughput.py``).
LARGE = 4 * 1024 * 1024
#: glibc's largest mmap threshold on 64-bit: a buffer above it is always a new mapping.
MMAP_CEILING = 32 * 1024 * 1024


def _references(buffer: torch.Tensor) -> tuple[int, int] | None:
    """(Python references to ``buffer``'s storage object, tensors and exports sharing the storage),
    or ``None`` where this torch cannot tell (then nothing is reused)."""
    if _storage_use_count is None:
        return None
    storage = buffer.untyped_storage()
    return sys.getrefcount(storage), _storage_use_count(storage._cdata)


class Recycler:
    """One kept CPU buffer per key (a bucket), handed out again zeroed when nobody else holds it.

    ``min_bytes``: smaller buffers are always made afresh (see :data:`LARGE`).
    """

    def __init__(self, min_bytes: int = 0) -> None:
        self.min_bytes = min_bytes
        # key -> (buffer, its references when only this recycler held it)
        self._kept: dict[Hashable, tuple[torch.Tensor, tuple[int, int] | None]] = {}

    def zeros(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D zero tensor of ``numel`` elements: the one kept under ``key`` if nothing outside
        this recycler refers to it any more (see the module doc), else a new one, kept from now on."""
        return self._take(key, numel, dtype, device, torch.zeros, zeroed)

    def empty(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """As :meth:`zeros`, for a caller that overwrites every element: the contents are undefined."""
        return self._take(key, numel, dtype, device, torch.empty, None)

    def _take(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device,
              make: Callable[..., torch.Tensor], clear: Callable[[torch.Tensor], torch.Tensor] | None,
              ) -> torch.Tensor:
        if numel * dtype.itemsize < self.min_bytes:
            return make(numel, dtype=dtype, device=device)
        kept = self._kept.get(key)
        if kept is not None:
            buffer, alone = kept
            if (alone is not None and buffer.numel() == numel and buffer.dtype == dtype
                    and buffer.device == device and _references(buffer) == alone):
                return buffer if clear is None else clear(buffer)
        buffer = make(numel, dtype=dtype, device=device)
        if paths.cpu_path(buffer):
            self._kept[key] = (buffer, _references(buffer))
        else:
            self._kept.pop(key, None)
        return buffer

    def clear(self) -> None:
        """Let go of every kept buffer (their memory is freed once the caller's references go)."""
        self._kept.clear()
