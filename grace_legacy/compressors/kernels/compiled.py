"""What the compiled CPU loops share: one switch, one way to compile them, and how many threads a
pass gets. Each kernel module builds its numba loops in its own ``_kernels()`` on first use, cached
on disk (docs/DESIGN.md#compiled-passes). Top-k's selection has no switch: its torch path is tested
directly. The wider switch, :mod:`grace_legacy.runtime.paths`, sends every CPU tensor down the
device path.

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

import torch

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


#: Whether this process is a fork's child: its passes run on one thread (see :func:`threads_for`).
_FORKED = False


@functools.cache
def _numba() -> Any:
    """numba, with its threading layer chosen (docs/DESIGN.md#threads) before any parallel loop runs:
    GNU OpenMP where numba can load it, else numba's own ``workqueue``; ``NUMBA_THREADING_LAYER``
    overrides both."""
    import numba

    if not os.environ.get("NUMBA_THREADING_LAYER"):
        numba.config.THREADING_LAYER = "omp" if _openmp_loads() else "workqueue"
    return numba


def _openmp_loads() -> bool:
    try:
        from numba.np.ufunc import omppool  # noqa: F401  (needs the system's libgomp)
    except (ImportError, OSError):
        return False
    return True


def loop() -> Callable:
    """The decorator that compiles a loop (``njit``, GIL released, cached, no bounds checks: the
    callers check sizes). Imports numba, so call it inside a ``_kernels()``."""
    return _named(_numba().njit(nogil=True, cache=True, boundscheck=False), "loop")


def parallel_loop() -> Callable:
    """As :func:`loop`, for a loop whose ``numba.prange`` runs on several threads; run it through
    :func:`run`, which sets how many."""
    return _named(_numba().njit(nogil=True, cache=True, boundscheck=False, parallel=True), "parallel")


def inline_loop() -> Callable:
    """As :func:`loop`, for a helper numba inlines into the loops that call it."""
    return _named(_numba().njit(inline="always"), "inline")


def _named(decorator: Callable, kind: str) -> Callable:
    """``decorator``, giving each compiled loop an identity derived from its name.

    A loop that calls another holds it in its closure, and numba keys a cached loop on the pickled
    closure, whose compiled callees pickle with their identity, a random uuid per process unless
    set: every process then missed the disk cache of such a loop (the parallel passes and the
    block helpers they call) and compiled it again for each dtype. The name (module, qualified name,
    kind) is unique per loop and the same in every process, so the key is too."""

    def compile_loop(function: Callable) -> Any:
        dispatcher = decorator(function)
        dispatcher._set_uuid(f"grace_legacy:{function.__module__}.{function.__qualname__}:{kind}")
        return dispatcher

    return compile_loop


def blocks(n: int) -> int:
    """How many blocks of :data:`BLOCK` elements cover ``n`` elements (the last may be short)."""
    return -(-n // BLOCK)


def pool_size() -> int:
    """Threads in numba's pool (``NUMBA_NUM_THREADS``): the most a pass can run on."""
    return _numba().config.NUMBA_NUM_THREADS


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
    numba = _numba()
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
