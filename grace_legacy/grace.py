"""The ``Grace`` bundle: one compressor, one memory, one communicator, run for every tensor.

For a gradient ``g`` named ``name`` (docs/ARCHITECTURE.md#one-step-one-way)::

    compensated  = memory.compensate(g, name)                  # e.g. g + e
    c            = compressor.compressor_for(compensated, name) # None: send it dense
    route        = the route of c's own aggregation (or "auto"'s, or the communicator's)
    payload, ctx = c.compress(compensated, name)
    memory.update(compensated, name, c, payload, ctx)          # once, with what was really sent
    result       = memory.aggregated(name, communicator's aggregate of every rank's payload)

Fused sending is :class:`~grace_legacy.communicators.fusion.Fusion`'s, the step's guards (inf and
NaN on any rank, undoing a skipped step) :class:`~grace_legacy.step_guard.StepGuard`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from grace_legacy.communicators import Allgather, Allreduce, ScatterGather
from grace_legacy.communicators.fusion import Fusion, checked_bucket_bytes
from grace_legacy.compressors import NoCompression
from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator, Parcel
from grace_legacy.core.compressor import Compressor, Payload, Tunable
from grace_legacy.core.memory import Encoder, Memory, NoMemory
from grace_legacy.core.seeds import derived_seed
from grace_legacy.core.state import refuse_other_configuration, saved_configuration
from grace_legacy.memories import Residual
from grace_legacy.runtime.advice import RouteAdvice
from grace_legacy.runtime.cost import choose_route, ring_allreduce_bytes
from grace_legacy.runtime.placement import Placement
from grace_legacy.runtime.stall import RanksStalled, resolve_stall_timeout
from grace_legacy.runtime.traffic import TrafficStats
from grace_legacy.runtime.validation import check_flag
from grace_legacy.schedules.base import Schedule
from grace_legacy.step_guard import StepGuard

_DENSE = NoCompression()
_ALLREDUCE = Allreduce()
#: The communicator of each route the bundle chooses by itself.
_COMMUNICATORS = {"allreduce": _ALLREDUCE, "allgather": Allgather(), "scattergather": ScatterGather()}
#: The word that asks for the route of fewest link bytes per tensor, the scatter-gather included.
AUTO = "auto"


class Grace:
    """Compressor + memory + communicator, as in GRACE (Xu et al., 2021), run for every tensor; passed
    as ``compression=`` to ``hvd.DistributedOptimizer`` (as is a bare compressor) or to the DDP hook.
    :attr:`stats` reports the bytes sent. A tensor left uncompressed (density 1.0, a schedule's
    ``None``, an empty tensor) takes a plain dense allreduce and leaves no residual.

    * ``memory=None``: the compressor's recommended memory.
    * ``communicator=None``: per tensor, the route that keeps the compressor's own aggregation
      (the algorithm its paper and GRACE define): an allreduce for additive payloads, an allgather
      of every rank's payload otherwise, or dense where that puts no more bytes on the link.
      ``communicator="auto"``: the route of fewest link bytes per tensor, the two-phase
      scatter-gather included from three ranks; its owners re-compress the sum of a shard, a
      different algorithm (``ScatterGather()`` forces it). Where the default puts far more on the
      link than the two-phase route would, rank 0 logs one line at the first step saying so
      (:class:`~grace_legacy.runtime.advice.RouteAdvice`; never with a communicator named).
    * ``dense_fallback``: a gathered payload that would move at least as many bytes as a ring
      allreduce of the dense tensor is sent dense (route ``"dense-fallback"``).
    * ``bucket_bytes``: fused buckets of up to this many dense bytes once :meth:`plan_buckets` has
      the tensors (``None``: ``HOROVOD_FUSION_THRESHOLD`` as Horovod reads it, at most 16 MiB;
      ``0``: per tensor; a communicator that does not fuse, such as ``Broadcast``, never is).
    * ``stall_timeout``: seconds a rank waits for one collective before it raises
      :class:`~grace_legacy.runtime.stall.RanksStalled` naming the gradient and the ranks it waits
      for (``None``: ``GRACE_LEGACY_STALL_TIMEOUT``, else 1800 s).
    """

    def __init__(self, compressor: Compressor, memory: Memory | None = None,
                 communicator: Communicator | str | None = None, *, dense_fallback: bool = True,
                 bucket_bytes: int | None = None, stall_timeout: float | None = None) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"Grace: compressor must be a grace_legacy Compressor, got {type(compressor).__name__}")
        #: Whether routes are chosen by link bytes alone (``communicator="auto"``).
        self.byte_optimal = isinstance(communicator, str) and communicator == AUTO
        communicator = None if self.byte_optimal else communicator
        _check_arguments(compressor, memory, communicator)
        self.dense_fallback = check_flag(dense_fallback, "dense_fallback", "Grace")
        self.stall_timeout = resolve_stall_timeout(stall_timeout)
        self.compressor, self.communicator = compressor, communicator
        self._schedule = compressor if isinstance(compressor, Schedule) else None
        #: the bytes this rank sent, by route (and by a schedule's groups and phases): :attr:`stats`
        self.traffic = TrafficStats()
        self.memory = memory if memory is not None else compressor.recommended_memory()
        compressor.check_memory(self.memory)
        self.memory.check_compressor(compressor)
        #: the error feedback a scatter-gather's owners apply before re-compressing what they summed,
        #: for a compressor that is paired with error feedback of its own (a biased one)
        self.owner_memory: Memory | None = (None if isinstance(compressor.recommended_memory(), NoMemory)
                                            else Residual())
        self.fusion = Fusion(checked_bucket_bytes(bucket_bytes, "Grace"), compressor.traits.spans_step)
        self.guard = StepGuard(compressor, self.memory, self.owner_memory, self.fusion.flat_of)
        self._routes: dict[tuple, str] = {}
        # The first step's link bytes on the default routes, for one line of advice; None once given,
        # or where the user chose the communicator.
        self._advice = None if communicator is not None or self.byte_optimal else RouteAdvice()
        self.placement = Placement()

    @property
    def bucket_bytes(self) -> int:
        """The largest fused bucket, in dense bytes (``0``: none)."""
        return self.fusion.bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, value: int) -> None:
        self.fusion.bucket_bytes = value

    def plan_buckets(self, sizes: Sequence[tuple[str, int]]) -> None:
        """Fuse the tensors named in ``sizes`` ((name, dense bytes), in expected arrival order)
        into buckets of up to :attr:`bucket_bytes`. Every rank must give the same list."""
        if self.communicator is None or self.communicator.fusable:
            self.fusion.plan_buckets(sizes)

    def route_of(self, concrete: Compressor, shape: torch.Size, dtype: torch.dtype, world_size: int) -> str:
        """The route of a tensor that ``concrete`` compresses at ``world_size`` ranks
        (:func:`~grace_legacy.runtime.cost.choose_route` with this bundle's settings), the same on
        every rank."""
        key = (id(concrete), shape, dtype, world_size)
        route = self._routes.get(key)
        if route is None:
            forced = None if self.communicator is None else self.communicator.route
            route = self._routes[key] = choose_route(concrete, shape, dtype, world_size, forced=forced,
                                                     dense_fallback=self.dense_fallback,
                                                     byte_optimal=self.byte_optimal)
        return route

    def start(self, tensor: torch.Tensor, name: str, backend: Backend, average: bool,
              overwrite: bool = False, hold: bool = False) -> Pending:
        """Compress ``tensor`` and launch its collectives; call the result to get the gradient.
        ``overwrite``: the caller will not read ``tensor`` again, so the memory may build the
        compensated gradient in its storage. ``hold``: keep it for ``fusion.launch_held``."""
        self.join_world(backend)
        if self.fusion.holds_for_step(name):  # held for the step's flats, which come back through here
            return self.fusion.hold_for_step(tensor, name, functools.partial(
                self.start, backend=backend, average=average, overwrite=True))
        compensated = self.guard.compensate(tensor, name, overwrite)
        world_size = backend.size()
        concrete = self.compressor.compressor_for(compensated, name) if tensor.numel() else None
        route = "dense" if concrete is None else self.route_of(concrete, tensor.shape, tensor.dtype, world_size)
        if self._advice is not None:
            self._advice.weigh(concrete, tensor, route, world_size)
        if route == "dense":
            # The compensated gradient itself, so a residual left from compressed steps is delivered.
            route = "dense" if concrete is None else "dense-fallback"
            concrete, payload, ctx, communicator = _DENSE, [compensated], None, _ALLREDUCE
        else:
            communicator = self.communicator or _COMMUNICATORS[route]
            # A communicator that compresses does it shard by shard itself.
            payload, ctx = ([compensated], None) if communicator.compresses else concrete.compress(compensated, name)
        parcel = Parcel(name, payload, ctx, concrete, communicator,
                        functools.partial(self._feed_back, compensated, name, concrete), self.owner_memory)
        inner = self.guard.started[name] = self.fusion.send(parcel, backend, average, hold)
        return Pending(functools.partial(self._finish, inner, name, tensor, route, world_size))

    def _feed_back(self, compensated: torch.Tensor, name: str, concrete: Compressor, payload: Payload, ctx: Any,
                   encoder: Encoder | None = None) -> None:
        """Error feedback, the one place for every route: the memory learns from the last local
        payload a communicator sends (decoded by ``encoder`` where the payload was compressed segment
        by segment), before it is sent."""
        self.memory.update(compensated, name, encoder or concrete, payload, ctx)

    def _finish(self, inner: Pending, name: str, tensor: torch.Tensor, route: str, world_size: int) -> torch.Tensor:
        try:
            arrived = inner()
        except RanksStalled as err:
            raise err.carrying(self.fusion.carried_with(name)) from None
        result = self.memory.aggregated(name, arrived)
        if not inner.finite:  # a compressor can overflow finite input (FP16 beyond 65504)
            self.guard.watch(name, result)
        if self._schedule is not None:
            self._schedule.observe(name, result)
        # Recorded on arrival: a multi-round payload's later rounds are only sent in inner().
        self.record_traffic(name, tensor, inner.bytes_sent, route, inner.wire_bytes, world_size)
        return result

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

    def start_whole(self, label: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], names: Sequence[str],
                    backend: Backend, average: bool) -> Pending | None:
        """A caller's fused bucket ``flat`` (1-D; ``tensors``, named ``names``, lie back to back in
        it) sent as one tensor (:meth:`Fusion.start_whole`), where that computes what :meth:`start`
        of each would, bit for bit: an elementwise compressor, no memory, no schedule, every tensor
        on the allreduce route. On a fast link the per-tensor work is what a step waits for. The
        result is ``flat`` itself, decoded in place; ``None``: start the tensors one by one."""
        self.join_world(backend)
        compressor, world_size = self.compressor, backend.size()
        if not (compressor.traits.elementwise and self._schedule is None and type(self.memory) is NoMemory
                and self.guard.flags_from_results):
            return None

        def alone(tensor: torch.Tensor, name: str) -> bool:
            return (tensor.numel() > 0 and compressor.compressor_for(tensor, name) is compressor
                    and self.route_of(compressor, tensor.shape, tensor.dtype, world_size) == "allreduce")

        pending = self.fusion.start_whole(label, flat, tensors, names, compressor, backend, average,
                                          self.guard.watch, self.traffic, alone)
        if pending is not None:
            for tensor, name in zip(tensors, names, strict=True):
                if self._advice is not None:
                    self._advice.weigh(compressor, tensor, "allreduce", world_size)
                self.guard.started[name] = pending
        return pending

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
                "buckets": (f"{len(plan.buckets)} of up to {self.bucket_bytes} bytes "
                            f"(digest {derived_seed(plan.buckets):016x})") if plan else "none",
                "schedule progress (epochs)": "none" if progress is None else str(progress)}

    def configuration(self) -> dict[str, str]:
        """What a saved state is only valid for. Not the bucket size: fusion changes which
        collectives carry a tensor, not what is computed."""
        return {"compressor": self.compressor.configuration(), "memory": self.memory.configuration(),
                "communicator": self._communicator_label(), "dense_fallback": str(self.dense_fallback)}

    def _communicator_label(self) -> str:
        return repr(AUTO) if self.byte_optimal else repr(self.communicator)

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

    def __repr__(self) -> str:
        return f"Grace({self.compressor!r}, memory={self.memory!r}, communicator={self._communicator_label()})"


def _check_arguments(compressor: Compressor, memory: Memory | None, communicator: Communicator | str | None) -> None:
    """Refuse arguments that do not make a bundle, naming them."""
    if isinstance(communicator, str):
        raise ValueError(f"Grace: communicator must be a grace_legacy Communicator, None (the route of the "
                         f"compressor's own aggregation) or {AUTO!r} (the route of fewest link bytes), "
                         f"got {communicator!r}")
    if memory is not None and not isinstance(memory, Memory):
        raise TypeError(f"Grace: memory must be a grace_legacy Memory, got {type(memory).__name__}")
    if communicator is not None and not isinstance(communicator, Communicator):
        raise TypeError(f"Grace: communicator must be a grace_legacy Communicator, got {type(communicator).__name__}")
    if isinstance(compressor, Tunable):
        compressor.check_ready()
    if communicator is not None:
        try:
            communicator.check_compressor(compressor)
        except ValueError as err:
            raise ValueError(f"Grace: {err}; or leave communicator=None") from None


def as_bundle(compression: Compressor | Grace, owner: str, communicator: Communicator | str | None = None) -> Grace:
    """``compression`` as a ``Grace`` bundle: a bundle as it is, a compressor or schedule (``TopK``,
    ``Legacy``, ``Accordion``...) with its recommended memory and ``communicator`` (``None``: the
    default; ``"auto"``: the fewest link bytes). Both training paths (Horovod's optimizer, the DDP
    hook) accept the same ``compression`` this way."""
    if isinstance(compression, Grace):
        if communicator is not None:
            raise ValueError(f"{owner}: communicator={communicator!r} was given with a Grace bundle, which has its "
                             f"own ({compression._communicator_label()}); name it in the bundle: "
                             f"Grace(..., communicator={communicator!r})")
        return compression
    if isinstance(compression, Compressor):
        return Grace(compression, communicator=communicator)
    raise TypeError(f"{owner}: compression must be a grace_legacy compressor, schedule (Legacy, DGCWarmup, "
                    f"Accordion, LGreCo) or Grace bundle, got {type(compression).__name__}")
