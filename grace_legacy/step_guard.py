"""A step's guards: which tensors held an inf or NaN on *any* rank, so that ``torch.amp.GradScaler``
skips the step on every rank alike, and undoing what a skipped or abandoned step changed in the
compression state (why and how: docs/DESIGN.md#skipped-steps).

Compression can hide a non-finite gradient from the other ranks (Top-k may not pick it, a sign
drops it) or make one (FP16 overflows), so each tensor's extremes are kept at three points: the
raw gradient (unless the memory keeps infs and NaNs in what it compensates), the compensated
gradient (finite state can overflow) and the result (unless the communicator saw it finite).
A gradient sent inside the step's flat (a compressor that spans the step) has the flat's extremes
and state: one inf flags every gradient of the flat, and undoing one undoes the flat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.compressor import Compressor
from grace_legacy.core.memory import Memory


class StepGuard:
    """The guards of one bundle's steps: extremes per tensor, the tensors started this step.
    ``flat_of``: the flat each gradient sent in the step's flat is kept under (``Fusion.flat_of``)."""

    def __init__(self, compressor: Compressor, memory: Memory, owner_memory: Memory | None,
                 flat_of: Mapping[str, str] | None = None) -> None:
        self.compressor, self.memory, self.owner_memory = compressor, memory, owner_memory
        self.flat_of: Mapping[str, str] = {} if flat_of is None else flat_of
        #: whether every rank's results show any rank's inf or NaN, so no flags need exchanging
        self.flags_from_results = (compressor.traits.delivers_nonfinite and memory.keeps_nonfinite
                                   and type(memory).aggregated is Memory.aggregated)
        # Per tensor of the step: the extremes looked at, all at once, in nonfinite_names.
        self._extremes: dict[str, list[torch.Tensor]] = {}
        #: the tensors started this step (what undo_step rolls back)
        self.started: dict[str, Pending] = {}

    def compensate(self, tensor: torch.Tensor, name: str, overwrite: bool, borrowed: bool = False) -> torch.Tensor:
        """The memory's compensated gradient (built in ``tensor``'s storage where ``overwrite``, and
        perhaps for the step where ``borrowed``: :meth:`Memory.compensate_borrowed`), with the
        extremes it needs looked at."""
        self._extremes[name] = []
        watch = not self.flags_from_results  # else the result will show it
        if watch and not self.memory.keeps_nonfinite:
            self.watch(name, tensor)  # first: compensate may write over it
        compensate = self.memory.compensate_into if overwrite else \
            self.memory.compensate_borrowed if borrowed else self.memory.compensate
        compensated = compensate(tensor, name)
        if watch and (compensated is not tensor or self.memory.keeps_nonfinite):
            self.watch(name, compensated)
        return compensated

    def watch(self, name: str, tensor: torch.Tensor) -> None:
        """Remember ``tensor``'s extremes (NaN or infinite exactly when an entry is)."""
        if tensor.numel():
            self._extremes.setdefault(name, []).extend(torch.aminmax(tensor.detach()))

    def nonfinite_names(self, names: Sequence[str], backend: Backend) -> set[str]:
        """Which of ``names`` held an inf or NaN on *any* rank this step. A collective unless the
        results already show it: every rank passes the same ``names`` in the same order."""
        extremes: list[torch.Tensor] = []
        owners: list[int] = []
        for index, name in enumerate(names):
            found = self._extremes.get(self.flat_of.get(name, name), ())
            extremes.extend(found)
            owners.extend([index] * len(found))
        self._extremes.clear()
        if not extremes and self.flags_from_results:
            return set()  # nothing looked non-finite, and no rank's flags need hearing
        flags = torch.zeros(len(names))
        if extremes:
            nonfinite = ~torch.isfinite(torch.stack(extremes))  # stack promotes mixed dtypes exactly
            flags = flags.to(nonfinite.device).index_add_(0, torch.tensor(owners, device=nonfinite.device),
                                                          nonfinite.to(torch.float32))
        summed = flags if self.flags_from_results else \
            backend.wait(backend.allreduce_async(flags, "nonfinite-flags", average=False))
        return {n for n, flagged in zip(names, summed.tolist(), strict=True) if flagged > 0}

    def undo(self, name: str) -> None:
        """Undo this step's changes to ``name``'s memory and compressor state (a skipped step)."""
        name = self.flat_of.get(name, name)
        self.memory.undo(name)
        self.compressor.undo(name)  # with the state of its segments (ScatterGather's segment names)
        if self.owner_memory is not None:
            self.owner_memory.undo(name)  # the owner's feedback on the segments of ``name``

    def undo_step(self, unlaunched: set[str]) -> None:
        """Forget the step under way: every started tensor this rank launched is waited for and
        dropped first (``unlaunched`` ones never will be), so that nothing is in flight under a name
        the next step uses; an error there is the engine's failure, which the step already raised:
        the wait stops, as nothing is in flight any more. Then every started tensor is undone."""
        for name, pending in self.started.items():
            if name not in unlaunched:
                try:
                    pending()
                except Exception:  # noqa: BLE001 (the engine's failure, already raised by the step)
                    break
        for name in self.started:
            self.undo(name)
        self.started.clear()
        self._extremes.clear()
