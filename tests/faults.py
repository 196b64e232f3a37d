"""Fault injection: the engine fails at a chosen point of a step.

:class:`FaultInjector` wraps a real backend (Horovod's, torch.distributed's, or the in-process one)
and counts the *points* a step reaches: each collective launch, each wait, and each call of the
compressor's ``compress``/``decompress`` and the memory's ``update`` (patched on their classes while
the injector is :meth:`watching`). Armed with ``(kind, n)``, it raises the engine's own exception
at the ``n``-th point of that kind, and from then on at every launch and wait, as an engine that
has shut down does, until :meth:`recover`. Recovering waits (for real) for every collective
launched before the fault and not yet waited for, so that nothing is left in flight when training
resumes: what a real engine's shutdown and re-initialisation achieve.

Every rank arms the same point, so every rank launched the same collectives before it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

KINDS = ("launch", "wait", "compress", "decompress", "update")


class FaultInjector:
    def __init__(self, backend: Any, error: type[BaseException]) -> None:
        self.inner, self.error = backend, error
        self.counts: Counter[str] = Counter()
        self.armed: tuple[str, int] | None = None
        self.tripped: tuple[str, int] | None = None
        self._in_flight: dict[int, Any] = {}

    # -- the Backend protocol, passed through ------------------------------------------------
    def rank(self) -> int:
        return self.inner.rank()

    def size(self) -> int:
        return self.inner.size()

    def __getattr__(self, name: str) -> Any:  # open_board, board, process_set, ...
        return getattr(self.inner, name)

    def allreduce_async(self, tensor: Any, name: str, average: bool) -> Any:
        self.point("launch")
        return self._track(self.inner.allreduce_async(tensor, name, average))

    def allreduce_owned_async(self, tensor: Any, name: str, average: bool) -> Any:
        # The in-place allreduce of a tensor the caller gives up (a fused flat, a DDP bucket's cast).
        self.point("launch")
        reduce = getattr(self.inner, "allreduce_owned_async", self.inner.allreduce_async)
        return self._track(reduce(tensor, name, average))

    def allgather_async(self, tensor: Any, name: str) -> Any:
        self.point("launch")
        return self._track(self.inner.allgather_async(tensor, name))

    def broadcast_async(self, tensor: Any, root_rank: int, name: str) -> Any:
        self.point("launch")
        return self._track(self.inner.broadcast_async(tensor, root_rank, name))

    def alltoall_async(self, tensor: Any, splits: Any, name: str) -> Any:
        self.point("launch")
        return self._track(self.inner.alltoall_async(tensor, splits, name))

    def wait(self, handle: Any) -> Any:
        self.point("wait")
        self._in_flight.pop(id(handle), None)
        return self.inner.wait(handle)

    def _track(self, handle: Any) -> Any:
        self._in_flight[id(handle)] = handle
        return handle

    # -- faults -----------------------------------------------------------------------------
    def point(self, kind: str) -> None:
        """The step reached a point of ``kind``: count it, and fail there if armed (or down)."""
        self.counts[kind] += 1
        if self.tripped is not None and kind in ("launch", "wait"):
            raise self.error(f"injected: the engine is down since {self.tripped[0]} #{self.tripped[1]}")
        if self.armed == (kind, self.counts[kind] - 1):
            self.tripped, self.armed = self.armed, None
            raise self.error(f"injected fault at {kind} #{self.counts[kind] - 1}")

    def arm(self, kind: str, n: int) -> None:
        """Fail at the ``n``-th (0-based) point of ``kind`` from now on."""
        assert kind in KINDS
        self.counts.clear()
        self.armed, self.tripped = (kind, n), None

    def count_from_now(self) -> None:
        self.counts.clear()
        self.armed = self.tripped = None

    def recover(self) -> None:
        """The engine is back: wait for what was launched before the fault, forget the fault."""
        self.tripped = self.armed = None
        for handle in list(self._in_flight.values()):
            with contextlib.suppress(Exception):
                self.inner.wait(handle)
        self._in_flight.clear()

    @contextlib.contextmanager
    def watching(self, compressors: list[Any], memories: list[Any]) -> Iterator[None]:
        """Count (and fail at) ``compress``/``decompress`` of these compressors' classes (a flat's
        ``decompress_flat`` counts as a decompress) and ``update`` of these memories' classes while
        inside (each method patched where the class defines it)."""
        methods_of = ((compressors, ("compress", "decompress", "decompress_flat")), (memories, ("update",)))
        targets = {(first_definer(obj, method), method)  # decompress_flat: elementwise compressors only
                   for objects, methods in methods_of for obj in objects for method in methods if hasattr(obj, method)}
        patched = []
        for cls, method in sorted(targets, key=lambda target: (target[0].__qualname__, target[1])):
            original = cls.__dict__[method]
            patched.append((cls, method, original))
            setattr(cls, method, self._counting(method.removesuffix("_flat"), original))
        try:
            yield
        finally:
            for cls, method, original in reversed(patched):
                setattr(cls, method, original)

    def _counting(self, kind: str, original: Any) -> Any:
        injector = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            injector.point(kind)
            return original(*args, **kwargs)

        return counted


def first_definer(obj: Any, method: str) -> type:
    """The class in ``obj``'s MRO whose ``method`` a call on ``obj`` runs."""
    return next(cls for cls in type(obj).__mro__ if method in cls.__dict__)
