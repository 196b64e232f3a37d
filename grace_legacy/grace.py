"""The ``Grace`` bundle: one compressor, one memory, one communicator, run for every tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grace_legacy import wire
from grace_legacy.communicators import Allgather, Allreduce
from grace_legacy.compressors import NoCompression
from grace_legacy.core import Backend, Communicator, Compressor, Memory, Payload, Pending

_DENSE = NoCompression()
_ALLREDUCE = Allreduce()
_ALLGATHER = Allgather()


def bytes_sent(concrete: Compressor | None, shape: int | Sequence[int], dtype: torch.dtype) -> int:
    """Bytes a rank hands to the backend for one tensor (an element count or a shape) on the
    default route: the dense size when ``concrete`` is ``None``, the raw parts of every round for
    an allreduce, the packed buffer for an allgather."""
    shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
    if concrete is None:
        return shape.numel() * torch.empty((), dtype=dtype).element_size()
    spec = concrete.payload_spec_for(shape, dtype)
    if concrete.additive:
        return sum(n * torch.empty((), dtype=d).element_size() for n, d in spec)
    return wire.packed_size_of(spec, with_header=not concrete.uniform_payload)


class Grace:
    """Compressor + memory + communicator, as in GRACE (Xu et al., 2021).

    ``memory=None`` takes the compressor's recommended memory (``Residual`` for sparsifiers,
    ``NoMemory`` otherwise). ``communicator=None`` picks, per tensor, what its payload needs: an
    allreduce for additive payloads and an allgather for everything else. A tensor the compressor
    leaves uncompressed (``resolve`` returns ``None``: density 1.0, a LEGACY ``None`` value, an
    empty tensor) always takes a plain dense allreduce and leaves no residual behind.

    Passing a ``Grace`` (or a bare compressor) as ``compression=`` to
    ``hvd.DistributedOptimizer`` runs it on every gradient; ``.stats`` reports the bytes sent.
    """

    def __init__(self, compressor: Compressor, memory: Memory | None = None,
                 communicator: Communicator | None = None) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"Grace: compressor must be a grace_legacy Compressor, got {type(compressor).__name__}")
        if memory is not None and not isinstance(memory, Memory):
            raise TypeError(f"Grace: memory must be a grace_legacy Memory, got {type(memory).__name__}")
        if communicator is not None and not isinstance(communicator, Communicator):
            raise TypeError(f"Grace: communicator must be a grace_legacy Communicator, "
                            f"got {type(communicator).__name__}")
        compressor.check_ready()
        if communicator is not None and not communicator.carries_non_additive and not compressor.additive:
            raise ValueError(
                f"Grace: {communicator!r} sums payloads, but {compressor!r} sends a non-additive payload "
                f"(indices, signs or per-rank scales) that would be corrupted by summing; use Allgather() "
                f"or leave communicator=None")
        self.compressor = compressor
        self.memory = memory if memory is not None else compressor.recommended_memory()
        compressor.check_memory(self.memory)
        self.memory.check_compressor(compressor)
        self.communicator = communicator
        # Per tensor of the current step: did this rank's gradient hold an inf or NaN?
        self._nonfinite: dict[str, torch.Tensor] = {}

    def start(self, tensor: torch.Tensor, name: str, backend: Backend, average: bool) -> Pending:
        """Compress ``tensor`` and launch its collectives; call the result to get the gradient."""
        if backend.rank() != self.compressor.rank:
            self.compressor.set_rank(backend.rank())
        # A sparsifier or a sign may drop an inf; the flag makes sure every rank still sees it.
        self._nonfinite[name] = ~torch.isfinite(tensor).all()
        compensated = self.memory.compensate(tensor, name)
        concrete = self.compressor.resolve(compensated, name) if tensor.numel() else None
        if concrete is None:
            # Dense: the compensated gradient itself, so a residual left from compressed steps is
            # delivered now rather than lost.
            concrete, payload, ctx, communicator, route = _DENSE, [compensated], None, _ALLREDUCE, "dense"
        else:
            payload, ctx = concrete.compress(compensated, name)
            communicator = self.communicator or (_ALLREDUCE if concrete.additive else _ALLGATHER)
            route = communicator.route

        def learn(final_payload: Payload, final_ctx: Any) -> None:
            self.memory.update(compensated, name, concrete, final_payload, final_ctx)

        inner = communicator.start(payload, ctx, name, concrete, backend, average, on_final_payload=learn)

        def finish() -> torch.Tensor:
            result = self.memory.aggregated(name, inner())
            self.compressor.observe(name, result)
            # Recorded on arrival: a multi-round payload's later rounds are only sent in inner().
            self.compressor.record_traffic(name, tensor, inner.bytes_sent, route)
            return result

        return Pending(finish, inner.bytes_sent)

    # -- the end of a step ------------------------------------------------------------------
    def nonfinite_names(self, names: Sequence[str], backend: Backend) -> set[str]:
        """Which of ``names`` held an inf or NaN on *any* rank this step: one small allreduce of
        one flag per name. Every rank must pass the same ``names`` in the same order."""
        flags = torch.stack([self._nonfinite.get(n, torch.tensor(False)) for n in names]).to(torch.float32)
        self._nonfinite.clear()
        summed = backend.wait(backend.allreduce_async(flags, "nonfinite-flags", average=False))
        return {n for n, flagged in zip(names, summed.tolist(), strict=True) if flagged > 0}

    def discard(self, name: str) -> None:
        """Undo this step's changes to ``name``'s memory and compressor state (skipped step)."""
        self.memory.rollback(name)
        self.compressor.rollback(name)

    def describe(self) -> dict[str, str]:
        """What every rank must agree on, as text (see :mod:`grace_legacy.consistency`)."""
        progress = getattr(self.compressor, "progress", None)
        return {"compressor": repr(self.compressor), "memory": repr(self.memory),
                "communicator": repr(self.communicator),
                "schedule progress (epochs)": "none" if progress is None else str(progress)}

    def set_epoch(self, epoch: int) -> None:
        """Enter epoch ``epoch``, like ``DistributedSampler.set_epoch`` (schedules change phase)."""
        self.compressor.set_epoch(epoch)

    def end_step(self, backend: Backend | None = None) -> None:
        """Count one synchronized optimizer step (the distributed optimizer calls this)."""
        self.memory.commit()
        self.compressor.commit()
        self.compressor.end_step(backend)

    @property
    def stats(self) -> dict[str, Any]:
        return self.compressor.stats

    def reset_stats(self) -> None:
        self.compressor.reset_stats()

    def state_dict(self) -> dict[str, Any]:
        return {"compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])

    def __repr__(self) -> str:
        return f"Grace({self.compressor!r}, memory={self.memory!r}, communicator={self.communicator!r})"
