"""What a :class:`~grace_legacy.grace.Grace` bundle carries across steps and worlds, beside its
per-tensor pipeline: the world it runs in (joined, left, a step undone), the end of each step, the
bytes it sent, what the ranks must agree on, and its checkpoint (docs/DESIGN.md#one-pipeline)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from grace_legacy.communicators.fusion import Fusion
from grace_legacy.core.backend import Backend
from grace_legacy.core.compressor import Compressor
from grace_legacy.core.memory import Memory
from grace_legacy.core.seeds import derived_seed
from grace_legacy.core.state import refuse_other_configuration, saved_configuration
from grace_legacy.runtime.advice import RouteAdvice
from grace_legacy.runtime.cost import ring_allreduce_bytes
from grace_legacy.runtime.placement import Placement
from grace_legacy.runtime.traffic import TrafficStats
from grace_legacy.schedules.base import Schedule
from grace_legacy.step_guard import StepGuard


class Lifetime(ABC):
    """The part of a bundle that outlives one tensor: :class:`~grace_legacy.grace.Grace` is one,
    and makes the parts these methods use."""

    compressor: Compressor
    memory: Memory
    owner_memory: Memory | None
    dense_fallback: bool
    fusion: Fusion
    guard: StepGuard
    traffic: TrafficStats
    placement: Placement
    _schedule: Schedule | None
    _advice: RouteAdvice | None

    @abstractmethod
    def _communicator_label(self) -> str:
        """The communicator as the description and the configuration name it."""

    # -- the step ------------------------------------------------------------------------------
    def join_world(self, backend: Backend) -> bool:
        """Take this rank's place in ``backend``'s world before sending; ``True`` when the place is
        new (the ranks' agreement should be checked again). A loaded state must be entered at the
        rank and size that saved it (``ValueError``); a change under a running bundle leaves the old
        world first (docs/DESIGN.md#elastic-state)."""
        rank, size = backend.rank(), backend.size()
        if not self.placement.is_new(rank, size):
            return False
        if self.placement.current is not None:
            self.leave_world()
        self.placement.enter(rank, size)
        self.compressor.set_rank(rank)
        return True

    def leave_world(self) -> None:
        """Drop the step under way and what only the old world's ranks share (the owners' shards;
        a memory that does not survive a change of world)."""
        self.undo_step()
        if not self.memory.survives_world_change:
            self.memory.reset()
        if self.owner_memory is not None:
            self.owner_memory.reset()
        self.placement.leave()

    def undo_step(self) -> None:
        """Forget the step under way (``load_state_dict`` in mid-step, an elastic restore): what this
        rank launched is waited for and dropped, buckets still collecting are emptied, and every
        started tensor is undone as for a skipped step (the step counters keep it: its collectives
        ran). Nothing that arrives reaches the memory, schedule or counts."""
        self.guard.undo_step(self.fusion.unlaunched())
        self.fusion.abandon()

    def end_step(self, backend: Backend | None = None) -> None:
        """Count one synchronized optimizer step (the distributed optimizer calls this)."""
        if self._advice is not None and backend is not None:
            self._advice.give(self.compressor, backend.rank(), backend.size())
            self._advice = None
        self.guard.started.clear()
        self.fusion.end_step()
        self.memory.end_step()
        if self.owner_memory is not None:
            self.owner_memory.end_step()
        self.compressor.end_step(backend)

    def set_epoch(self, epoch: int) -> None:
        """Enter epoch ``epoch``, like ``DistributedSampler.set_epoch`` (schedules change phase)."""
        if self._schedule is not None:
            self._schedule.set_epoch(epoch)

    # -- what it sent, and what the ranks must agree on ------------------------------------------
    def record_traffic(self, name: str, tensor: torch.Tensor, sent_bytes: int, route: str,
                       wire_bytes: float = 0.0, world_size: int = 1, dense_link: float | None = None) -> None:
        """Count ``sent_bytes`` handed to the collectives for ``tensor`` and ``wire_bytes`` put on
        the link, against a dense ring allreduce among ``world_size`` ranks, or ``dense_link`` bytes
        where the dense collective is another one (FSDP's reduce-scatter), under a schedule's labels."""
        labels = self._schedule.traffic_labels(name, tensor) if self._schedule is not None else None
        dense = tensor.numel() * tensor.element_size()
        self.traffic.record(dense_bytes=dense, sent_bytes=sent_bytes, route=route, wire_bytes=wire_bytes,
                            wire_dense=ring_allreduce_bytes(dense, world_size) if dense_link is None else dense_link,
                            labels=labels)

    @property
    def stats(self) -> dict[str, Any]:
        """This rank's traffic (:class:`~grace_legacy.runtime.traffic.TrafficStats`): bytes sent and
        on the link against a dense send, by route (and a schedule's groups and phases), with what
        its schedule decided (:attr:`Schedule.stats <grace_legacy.schedules.base.Schedule.stats>`)."""
        return {**self.traffic.as_dict(), **(self._schedule.stats if self._schedule is not None else {})}

    def scalars(self, prefix: str = "grace") -> dict[str, float]:
        """:attr:`stats` flattened for TensorBoard or W&B (``{"grace/volume": ..., ...}``)."""
        if not isinstance(prefix, str):
            raise TypeError(f"Grace.scalars: prefix must be a string (\"\" for none), got {type(prefix).__name__}")
        return self.traffic.scalars(self.stats, prefix)

    def reset_stats(self) -> None:
        self.traffic.reset()

    def describe(self) -> dict[str, str]:
        """What every rank must agree on, as text (see :mod:`grace_legacy.consistency`)."""
        progress = self._schedule.progress if self._schedule is not None else None
        plan = self.fusion.plan
        return {"compressor": repr(self.compressor), "memory": repr(self.memory),
                "communicator": self._communicator_label(), "dense_fallback": str(self.dense_fallback),
                "buckets": (f"{len(plan.buckets)} of up to {self.fusion.bucket_bytes} bytes "
                            f"(digest {derived_seed(plan.buckets):016x})") if plan else "none",
                "schedule progress (epochs)": "none" if progress is None else str(progress)}

    def configuration(self) -> dict[str, str]:
        """What a saved state is only valid for. Not the bucket size: fusion changes which
        collectives carry a tensor, not what is computed."""
        return {"compressor": self.compressor.configuration(), "memory": self.memory.configuration(),
                "communicator": self._communicator_label(), "dense_fallback": str(self.dense_fallback)}

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state, everything a run carries between steps: the memory's and
        compressor's per-tensor state (residuals, momenta, estimates, the step counters that fix
        every random draw, warm starts), a schedule's position and decisions, the byte counts, the
        :meth:`configuration` and which rank of how many saved it. Plain data, copied
        (``torch.load(..., weights_only=True)`` reads it); call it between steps. It differs from
        rank to rank: gather it, and have each rank load its own (docs/CHECKPOINTING.md). A run
        resumed from it ends bit for bit as the uninterrupted run, given the same data in the same
        order, world size, controller and Horovod settings."""
        return {"config": self.configuration(), "placement": self.placement.saved(),
                "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict(),
                "owner_memory": None if self.owner_memory is None else self.owner_memory.state_dict(),
                "traffic": self.traffic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, this rank's :meth:`state_dict` of an earlier run. ``ValueError``
        naming every difference, before changing anything, if another configuration saved it, and
        at the first step if another rank or number of ranks did."""
        saved = saved_configuration(state, "Grace.load_state_dict")
        refuse_other_configuration("Grace.load_state_dict", saved, self.configuration())
        self.placement.expect(state["placement"])
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        if self.owner_memory is not None:
            self.owner_memory.load_state_dict(state["owner_memory"])
        self.traffic.load_state_dict(state["traffic"])
