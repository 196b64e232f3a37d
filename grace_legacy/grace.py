"""The ``Grace`` bundle: one compressor, one memory, one communicator, run for every tensor.

For a gradient ``g`` named ``name`` (docs/ARCHITECTURE.md#one-step-one-way)::

    compensated  = memory.compensate(g, name)                  # e.g. g + e
    c            = compressor.compressor_for(compensated, name) # None: send it dense
    route        = the route of c's own aggregation (or "auto"'s, or the communicator's)
    payload, ctx = c.compress(compensated, name)
    memory.update(compensated, name, c, payload, ctx)          # once, with what was really sent
    result       = memory.aggregated(name, communicator's aggregate of every rank's payload)

Fused sending is :class:`~grace_legacy.communicators.fusion.Fusion`'s, the step's guards (inf and
NaN on any rank, undoing a skipped step) :class:`~grace_legacy.step_guard.StepGuard`'s, and what a
bundle carries across steps (its world, the end of a step, its bytes, its checkpoint)
:class:`~grace_legacy.lifetime.Lifetime`'s.
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
from grace_legacy.lifetime import Lifetime
from grace_legacy.memories import Residual
from grace_legacy.runtime.advice import RouteAdvice
from grace_legacy.runtime.cost import choose_route
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


class Grace(Lifetime):
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
              overwrite: bool = False, hold: bool = False, in_place: bool = False) -> Pending:
        """Compress ``tensor`` and launch its collectives; call the result to get the gradient.
        ``overwrite``: the caller will not read ``tensor`` again, so the memory may build the
        compensated gradient in its storage. ``hold``: keep it for ``fusion.launch_held``.
        ``in_place``: the caller reads ``tensor`` again only through the result, which may then be
        decoded into it (a multi-round payload, :meth:`MultiRound.decompress_into`), and the memory
        may build the compensated gradient there for the step (:meth:`Memory.compensate_borrowed`)."""
        self.join_world(backend)
        if self.fusion.holds_for_step(name):  # held for the step's flats, which come back through here
            return self.fusion.hold_for_step(tensor, name, functools.partial(
                self.start, backend=backend, average=average, overwrite=True))
        compensated = self.guard.compensate(tensor, name, overwrite, borrowed=in_place)
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
                        functools.partial(self._feed_back, compensated, name, concrete), self.owner_memory,
                        into=tensor if in_place else None)
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

    def start_whole(self, label: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], names: Sequence[str],
                    backend: Backend, average: bool) -> Pending | None:
        """A caller's fused bucket ``flat`` (1-D; tensors named ``names`` lie back to back in it,
        ``tensors`` giving their shapes and dtypes: they, or tensors like them) sent as one tensor
        (:meth:`Fusion.start_whole`), where that computes what :meth:`start` of each would, bit for
        bit: an elementwise compressor, no memory, no schedule, every tensor on the allreduce
        route. On a fast link the per-tensor work is what a step waits for. No
        inf/NaN pass either: every rank's result shows any rank's inf or NaN (the guard's
        ``flags_from_results``), and with no state to undo (no memory, no schedule, a compressor
        without an undo log) a skipped step has nothing to roll back. The result is ``flat``
        itself, decoded in place; ``None``: start the tensors one by one."""
        self.join_world(backend)
        compressor, world_size = self.compressor, backend.size()
        if not (compressor.traits.elementwise and self._schedule is None and type(self.memory) is NoMemory
                and compressor.undo_log is None and self.guard.flags_from_results):
            return None

        def alone(tensor: torch.Tensor, name: str) -> bool:
            return (tensor.numel() > 0 and compressor.compressor_for(tensor, name) is compressor
                    and self.route_of(compressor, tensor.shape, tensor.dtype, world_size) == "allreduce")

        pending = self.fusion.start_whole(label, flat, tensors, names, compressor, backend, average,
                                          self.traffic, alone)
        if pending is not None:
            for tensor, name in zip(tensors, names, strict=True):
                if self._advice is not None:
                    self._advice.weigh(compressor, tensor, "allreduce", world_size)
                self.guard.started[name] = pending
        return pending

    def _communicator_label(self) -> str:
        return repr(AUTO) if self.byte_optimal else repr(self.communicator)

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
