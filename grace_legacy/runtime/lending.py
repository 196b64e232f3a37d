"""Tensors lent to a collective library, held from C++ until the library has let go of them
(why: docs/DESIGN.md#clean-exit).

The promise: while a collective library (Gloo's worker threads, Horovod's background thread) holds
a tensor that :meth:`Lender.lend` was given, a C++ container of this module holds it too, so the
library's release of it is never the last C++ reference besides the tensor's Python object, the
release after which torch decrements the Python object and needs the GIL. A library's thread then
lets go of a lent tensor without taking the GIL, whenever it does: at interpreter exit, or while
the thread holding the GIL waits for a lock that library thread holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Lender:
    """The tensors lent to one library, each with its C++ reference count as it was before the
    library took any (the *baseline*): a lent tensor is let go once its count is back there."""

    def __init__(self) -> None:
        self._held: list[tuple[torch.ScriptList, tuple[torch.Tensor, ...], tuple[int, ...]]] = []

    def lend(self, tensors: Iterable[torch.Tensor], taken: bool = False) -> None:
        """Hold ``tensors`` from C++ until the library lets go of them. Call it before handing them
        over; ``taken=True`` for tensors the library already holds (the baseline is then this
        module's hold and the Python object's, nothing else). Lets go of what was lent before and
        is back."""
        self.release_returned()
        tensors = tuple(tensors)
        if not tensors:
            return
        holder = torch.ScriptList(list(tensors))
        baseline = tuple(2 if taken else t._use_count() for t in tensors)
        self._held.append((holder, tensors, baseline))

    def release_returned(self) -> None:
        """Let go of every lent set that the library no longer holds any tensor of."""
        self._held = [entry for entry in self._held
                      if any(t._use_count() > count for t, count in zip(entry[1], entry[2], strict=True))]

    def __len__(self) -> int:
        return len(self._held)
