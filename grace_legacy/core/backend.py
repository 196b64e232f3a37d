"""What a communicator needs from a collective library, and a result still on its way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class Backend(Protocol):
    """What a communicator needs from a collective library: asynchronous collectives over one group
    of ranks, matched across ranks by name (Horovod) or by issue order (torch.distributed)."""

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> Any: ...
    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any: ...
    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> Any: ...
    def alltoall_async(self, tensor: torch.Tensor, splits: list[int], name: str) -> Any:
        """Rows ``[sum(splits[:j]), sum(splits[:j+1]))`` of ``tensor`` go to rank ``j``; the result
        is what every rank sent this one, in rank order (the counts may differ between ranks)."""
        ...
    def wait(self, handle: Any) -> torch.Tensor: ...


class Pending:
    """A gradient on its way: ``pending()`` waits for the collectives and returns the result (later
    calls return the same tensor). ``bytes_sent``: what this rank handed to the backend; ``finite``:
    set by a communicator that has seen the result hold no inf or NaN, so nobody looks again.

    A communicator that launches later than it is handed the tensor (a fused bucket takes off once
    its last member arrives) makes the ``Pending`` first, with no ``finish``, and says how it
    finishes when it launches (:meth:`finish_with`, :meth:`fail_with`); waiting before that is a
    ``RuntimeError``."""

    __slots__ = ("bytes_sent", "wire_bytes", "finite", "_finish", "_result")

    def __init__(self, finish: Callable[[], torch.Tensor] | None = None, bytes_sent: int = 0) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish or _not_launched
        self._result: torch.Tensor | None = None
        self.bytes_sent = bytes_sent
        #: what the collectives put on this rank's link for it (runtime/traffic.py), once it arrived
        self.wire_bytes = 0.0
        self.finite = False

    def finish_with(self, finish: Callable[[], torch.Tensor]) -> None:
        """Compute the result with ``finish()`` when it is asked for (once; it waits for the collectives)."""
        self._finish = finish

    def fail_with(self, error: BaseException) -> None:
        """Raise ``error`` when the result is asked for: the launch failed, and its handles are spent."""
        self._finish = _Failed(error)

    def __call__(self) -> torch.Tensor:
        if self._finish is not None:
            try:
                self._result = self._finish()
            except BaseException as error:
                # A collective that failed stays failed: asking again raises the same error
                # instead of waiting again on spent handles.
                self._finish = _Failed(error)
                raise
            self._finish = None
        assert self._result is not None
        return self._result


def _not_launched() -> torch.Tensor:
    raise RuntimeError("a gradient was waited for before its collectives were launched (a fused bucket still "
                       "waits for other members)")


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self) -> torch.Tensor:
        raise self.error
