"""What the compiled CPU loops share: one switch, the decorators that compile them, and how many
threads a pass gets.

Every algorithm module in this package holds its torch formula (the reference, which every other
device runs), its loops compiled by numba, and one function that picks between them: the loops
where :func:`applies`, through :func:`run`, else the formula (docs/DESIGN.md#compiled-passes).
The loops are module-level functions that numba compiles on their first call and caches on disk
(:func:`loop`), so importing the package compiles nothing. The wider switch,
:mod:`grace_legacy.runtime.paths`, sends every CPU tensor down the device path.

A pass over ``n`` elements runs on :func:`threads_for` ``(n)`` threads: at most
``torch.get_num_threads()``, numba's pool, and one per :data:`PER_THREAD` elements (one in a
forked child). On several threads it goes over fixed blocks of :data:`BLOCK` elements whose
partial results are combined in block order, so every result is bit for bit the same whatever the
thread count (docs/DESIGN.md#threads).

A loop over a block slices its arrays to the block (an output from the block's first slot) and
counts from 0, adding the block's start only where an element's own index is needed (a
position, a random draw). Indexing from an unknown start, an input's or an output's, keeps
numba's negative-index wraparound in the loop, which stops LLVM from vectorizing it: such a loop
took several times the serial loop's time per element.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import numba
import numpy as np
import torch
from numba.extending import overload

from grace_legacy.runtime import paths

#: Whether the compiled loops run where they can; tests clear it to take the tensor path on CPU.
ENABLED = True

#: Elements per block of a pass that may run on several threads. Fixed, so that results never
#: depend on the thread count; a multiple of 64, so blocks split neither a byte of packed bits nor
#: a pair of elements that share a random word.
BLOCK = 1 << 16
#: The fewest elements worth giving one more thread: waking a pool thread costs tens of
#: microseconds, about what a pass does on this many elements.
PER_THREAD = 1 << 18

_LAUNCH = threading.Lock()


def applies(tensor: torch.Tensor, dtypes: Collection[torch.dtype] | None = None) -> bool:
    """Whether the compiled loops handle ``tensor``: a tensor on the CPU's own path
    (:func:`grace_legacy.runtime.paths.cpu_path`) while :data:`ENABLED`, of one of ``dtypes`` when
    they are given."""
    return ENABLED and paths.cpu_path(tensor) and (dtypes is None or tensor.dtype in dtypes)


def _compile(function: Callable, **options: Any) -> Callable:
    # numba looks for a writable cache folder when the decorator runs: the module's __pycache__,
    # NUMBA_CACHE_DIR, the user's cache. With none (a read-only install and home), it refuses to
    # cache: the loop then compiles in every process instead.
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False, **options)(function)
    except RuntimeError:
        return numba.njit(nogil=True, cache=False, boundscheck=False, **options)(function)


def loop(function: Callable) -> Callable:
    """Compiles ``function`` on its first call, for each new set of argument types: no Python
    objects, the GIL released, no bounds checks (the callers check sizes), and the machine code
    cached on disk, so a later process loads it instead of compiling (docs/DESIGN.md#compiled-passes)."""
    return _compile(function)


def parallel_loop(function: Callable) -> Callable:
    """As :func:`loop`, for a loop whose ``numba.prange`` runs on several threads; call it through
    :func:`run` or within :func:`launched`, which set how many."""
    return _compile(function, parallel=True)


def inline(function: Callable) -> Callable:
    """A helper of compiled loops, inlined into each loop that calls it (not called from Python)."""
    return numba.njit(inline="always")(function)


def is_single(x: Any) -> bool:  # pragma: no cover - replaced in compiled code
    """In compiled code, whether array ``x`` holds float32 (else float64): a constant of each
    compilation, so a loop keeps one dtype's code (a test of ``x.itemsize`` at run time kept both
    in every loop)."""
    raise NotImplementedError("is_single is only defined inside compiled loops")


@overload(is_single, inline="always")
def _is_single_compiled(x):  # pragma: no cover - compiled
    single = x.dtype.bitwidth == 32
    return lambda x: single


def empty(size: int, dtype: np.dtype | type) -> np.ndarray:
    """An uninitialized 1-D array of ``size`` elements, from torch's allocator. numpy's own asks the
    kernel for huge pages for every large array (``madvise``); where memory is fragmented, the
    first touch of each then waits for the kernel to compact memory, which made a pass that writes
    a tensor-long output several times slower for the first steps and uneven after. A pass's
    outputs become tensors anyway (``torch.from_numpy`` shares this memory)."""
    return torch.empty(size, dtype=_torch_dtype(np.dtype(dtype))).numpy()


def copy(array: np.ndarray) -> np.ndarray:
    """A copy of the 1-D ``array`` in memory from :func:`empty`."""
    out = empty(array.size, array.dtype)
    out[...] = array
    return out


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


#: Whether this process is a fork's child: its passes run on one thread (see :func:`threads_for`).
_FORKED = False


@functools.cache
def _choose_threading_layer() -> None:
    """Set numba's threading layer (docs/DESIGN.md#threads) before any parallel loop runs: GNU
    OpenMP where numba can load it, else numba's own ``workqueue``; ``NUMBA_THREADING_LAYER``
    overrides both."""
    if not os.environ.get("NUMBA_THREADING_LAYER"):
        numba.config.THREADING_LAYER = "omp" if _openmp_loads() else "workqueue"


def _openmp_loads() -> bool:
    try:
        from numba.np.ufunc import omppool  # noqa: F401  (needs the system's libgomp)
    except (ImportError, OSError):
        return False
    return True


def blocks(n: int) -> int:
    """How many blocks of :data:`BLOCK` elements cover ``n`` elements (the last may be short)."""
    return -(-n // BLOCK)


def pool_size() -> int:
    """Threads in numba's pool (``NUMBA_NUM_THREADS``): the most a pass can run on."""
    return numba.config.NUMBA_NUM_THREADS


def threads_for(n: int) -> int:
    """How many threads a pass over ``n`` elements runs on (see the module docstring): at least 1."""
    if _FORKED:
        return 1
    wanted = min(torch.get_num_threads(), n // PER_THREAD)
    return max(1, min(wanted, pool_size())) if wanted > 1 else 1


def run(serial: Callable, parallel: Callable, n: int, *args: Any) -> Any:
    """``serial(*args)`` when a pass over ``n`` elements gets one thread, else ``parallel(*args)`` on
    :func:`threads_for` ``(n)`` threads. The two must compute the same results (the parallel one
    by fixed blocks); only their speed differs."""
    threads = threads_for(n)
    if threads == 1:
        return serial(*args)
    with launched(threads):
        return parallel(*args)


@contextmanager
def launched(threads: int) -> Iterator[None]:
    """Within the block, this thread's parallel loops run on ``threads`` threads, and no other
    thread launches any (numba's workqueue layer, the fallback, must not be entered twice at once)."""
    _choose_threading_layer()
    with _LAUNCH:
        before = numba.get_num_threads()  # this thread's own setting, which other numba code may rely on
        numba.set_num_threads(threads)
        try:
            yield
        finally:
            numba.set_num_threads(before)


def _enter_child() -> None:
    # GNU OpenMP ends a forked child that launches a parallel loop after its parent did, so a
    # child's passes stay on one thread. And a fork while another thread held the lock would
    # leave the child's copy locked for good.
    global _LAUNCH, _FORKED
    _FORKED = True
    _LAUNCH = threading.Lock()


os.register_at_fork(after_in_child=_enter_child)
