"""The ``Grace`` bundle: one compressor, one memory, one communicator, run for every tensor."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from grace_legacy.communicators import Allgather, Allreduce, ScatterGather
from grace_legacy.communicators.buckets import BucketFiller, BucketPlan, default_bucket_bytes, launch_bucket
from grace_legacy.communicators.exchange import BucketExchange, Parcel
from grace_legacy.compressors import NoCompression
from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.core.seeds import derived_seed
from grace_legacy.core.state import refuse_other_configuration, saved_configuration
from grace_legacy.memories import Residual
from grace_legacy.runtime.buffers import BufferPool, views_of
from grace_legacy.runtime.cost import choose_route, ring_allreduce_bytes
from grace_legacy.runtime.stall import RanksStalled, resolve_stall_timeout
from grace_legacy.runtime.traffic import TrafficStats
from grace_legacy.runtime.validation import ArgumentTypeError, check_flag, is_int
from grace_legacy.runtime.whole_step import WholeStep
from grace_legacy.schedules.base import Schedule

_DENSE = NoCompression()
_ALLREDUCE = Allreduce()
#: The communicator of each route the bundle chooses by itself.
_COMMUNICATORS = {"allreduce": _ALLREDUCE, "allgather": Allgather(), "scattergather": ScatterGather()}


class Grace:
    """Compressor + memory + communicator, as in GRACE (Xu et al., 2021), run for every tensor; passed
    as ``compression=`` to ``hvd.DistributedOptimizer`` (as is a bare compressor) or to the DDP hook.
    :attr:`stats` reports the bytes sent. A tensor left uncompressed (density 1.0, a schedule's
    ``None``, an empty tensor) takes a plain dense allreduce and leaves no residual.

    * ``memory=None``: the compressor's recommended memory.
    * ``communicator=None``: per tensor, an allreduce for additive payloads, an allgather otherwise.
    * ``dense_fallback``: a gathered payload that would move at least as many bytes as a ring
      allreduce of the dense tensor is sent dense (route ``"dense-fallback"``).
    * ``bucket_bytes``: fused buckets of up to this many dense bytes once :meth:`plan_buckets` has
      the tensors (``None``: ``HOROVOD_FUSION_THRESHOLD`` as Horovod reads it, at most 16 MiB;
      ``0``: per tensor; ``Broadcast`` is never fused).
    * ``stall_timeout``: seconds a rank waits for one collective before it raises
      :class:`~grace_legacy.runtime.stall.RanksStalled` naming the gradient and the ranks it waits
      for (``None``: ``GRACE_LEGACY_STALL_TIMEOUT``, else 1800 s).
    """

    def __init__(self, compressor: Compressor, memory: Memory | None = None,
                 communicator: Communicator | None = None, *, dense_fallback: bool = True,
                 bucket_bytes: int | None = None, stall_timeout: float | None = None) -> None:
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
        if bucket_bytes is not None:
            if not isinstance(bucket_bytes, numbers.Real) or isinstance(bucket_bytes, (bool, torch.Tensor)):
                raise ArgumentTypeError(f"Grace: bucket_bytes must be None or an integer >= 0, got {bucket_bytes!r} "
                                        f"of type {type(bucket_bytes).__name__}")
            if not is_int(bucket_bytes) or bucket_bytes < 0:
                raise ValueError(f"Grace: bucket_bytes must be None or an integer >= 0, got {bucket_bytes!r}")
            bucket_bytes = int(bucket_bytes)
        self.dense_fallback = check_flag(dense_fallback, "dense_fallback", "Grace")
        self.stall_timeout = resolve_stall_timeout(stall_timeout)
        self.bucket_bytes = default_bucket_bytes() if bucket_bytes is None else bucket_bytes
        self._filler: BucketFiller | None = None
        self._routes: dict[tuple, str] = {}
        # Whether a caller's bucket (names, dtype, ranks) goes as one tensor (start_whole), and its
        # tensors' traffic rows once it went (the same every step).
        self._whole: dict[tuple, bool] = {}
        self._whole_rows: dict[tuple, list[tuple[int, int, float, float]]] = {}
        # Parcels started with hold=True, launched together by launch_held, and their buffers.
        self._held: list[Parcel] = []
        # The held buckets of this step with rounds still to run (advance_held).
        self._held_flights: list[BucketExchange] = []
        self._held_pool = BufferPool()
        self.compressor = compressor
        self._schedule = compressor if isinstance(compressor, Schedule) else None
        # A compressor that selects over the whole step gets the step's gradients as one flat.
        self._whole_step = WholeStep() if compressor.spans_step else None
        #: the bytes this rank sent, by route (and by a schedule's groups and phases): :attr:`stats`
        self.traffic = TrafficStats()
        compressor.ledger = self.traffic
        self.memory = memory if memory is not None else compressor.recommended_memory()
        compressor.check_memory(self.memory)
        self.memory.check_compressor(compressor)
        self.communicator = communicator
        if communicator is not None and communicator.compresses and compressor.rounds != 1:
            raise ValueError(f"Grace: {communicator!r} cannot run {compressor!r}, which needs {compressor.rounds} "
                             f"allreduce rounds; leave communicator=None")
        if communicator is not None and communicator.compresses and not compressor.shardable:
            raise ValueError(f"Grace: {communicator!r} compresses shards of tensors, but {compressor!r} compresses "
                             f"whole tensors only; use Allgather() or leave communicator=None")
        #: the error feedback a scatter-gather's owners apply before re-compressing what they summed,
        #: for a compressor that is paired with error feedback of its own (a biased one)
        self.owner_memory: Memory | None = (None if isinstance(compressor.recommended_memory(), NoMemory)
                                            else Residual())
        # Whether every rank's results show any rank's inf or NaN, so no flags need exchanging
        # (docs/DESIGN.md#skipped-steps).
        self._flags_from_results = (compressor.delivers_nonfinite and self.memory.keeps_nonfinite
                                    and type(self.memory).aggregated is Memory.aggregated)
        # Per tensor of the step: the extremes of its gradient, compensated gradient and result,
        # looked at all at once in nonfinite_names.
        self._extremes: dict[str, list[torch.Tensor]] = {}
        # The tensors started in the current step (what undo_step rolls back).
        self._started: dict[str, Pending] = {}
        # (rank, size) of the process set this bundle ran on, and the one a loaded state expects.
        self._placement: tuple[int, int] | None = None
        self._expected_placement: tuple[int, int] | None = None

    def plan_buckets(self, sizes: Sequence[tuple[str, int]]) -> None:
        """Fuse the tensors named in ``sizes`` ((name, dense bytes), in expected arrival order)
        into buckets of up to :attr:`bucket_bytes`. Every rank must give the same list."""
        fusable = self.communicator is None or self.communicator.fusable
        self._filler = BucketFiller(BucketPlan(sizes, self.bucket_bytes), self.owner_memory) \
            if fusable and self.bucket_bytes else None

    def route_of(self, concrete: Compressor, shape: torch.Size, dtype: torch.dtype, world_size: int) -> str:
        """The route of a tensor that ``concrete`` compresses at ``world_size`` ranks
        (:func:`~grace_legacy.runtime.cost.choose_route` with this bundle's communicator and
        dense fallback), the same on every rank."""
        key = (id(concrete), shape, dtype, world_size)
        route = self._routes.get(key)
        if route is None:
            forced = None if self.communicator is None else self.communicator.route
            route = self._routes[key] = choose_route(concrete, shape, dtype, world_size, forced=forced,
                                                     dense_fallback=self.dense_fallback)
        return route

    def start(self, tensor: torch.Tensor, name: str, backend: Backend, average: bool,
              overwrite: bool = False, hold: bool = False) -> Pending:
        """Compress ``tensor`` and launch its collectives; call the result to get the gradient.
        ``overwrite``: the caller will not read ``tensor`` again, so the memory may build the
        compensated gradient in its storage (:meth:`Memory.compensate_into`). For a compressor that
        :attr:`~grace_legacy.core.compressor.Compressor.spans_step`, the tensor is held and the step's
        tensors go as one when the first result is asked for (:mod:`grace_legacy.runtime.whole_step`)."""
        self.join_world(backend)
        if self._whole_step is not None and not self._whole_step.is_flat(name):
            held = self._started[name] = self._whole_step.hold(
                tensor, name, lambda flat, flat_name: self.start(flat, flat_name, backend, average, overwrite=True))
            return held
        # The raw gradient is looked at first (compensate may write over it) unless the memory keeps
        # its infs and NaNs; the compensated one always, since finite state can overflow.
        self._extremes[name] = []
        watch = not self._flags_from_results  # else the result will show it
        if watch and not self.memory.keeps_nonfinite:
            self._watch(name, tensor)
        compensated = (self.memory.compensate_into if overwrite else self.memory.compensate)(tensor, name)
        if watch and (compensated is not tensor or self.memory.keeps_nonfinite):
            self._watch(name, compensated)
        world_size = backend.size()
        concrete = self.compressor.compressor_for(compensated, name) if tensor.numel() else None
        route = "dense" if concrete is None else self.route_of(concrete, tensor.shape, tensor.dtype, world_size)
        if route == "dense":
            # Dense: the compensated gradient itself, so a residual left from compressed steps is
            # delivered now rather than lost.
            if concrete is not None:
                route = "dense-fallback"
            concrete, payload, ctx, communicator = _DENSE, [compensated], None, _ALLREDUCE
        else:
            communicator = self.communicator or _COMMUNICATORS[route]
            if communicator.compresses:  # it compresses shard by shard itself
                payload, ctx = [compensated], None
            else:
                payload, ctx = concrete.compress(compensated, name)

        def update_memory(final_payload: Payload, final_ctx: Any, encoder: Any = None) -> None:
            self.memory.update(compensated, name, encoder or concrete, final_payload, final_ctx)

        if communicator.fusable and (hold or (self._filler is not None and name in self._filler.plan.bucket_of)):
            parcel = Parcel(name, payload, ctx, concrete, gathered=communicator.carries_non_additive
                            and not communicator.compresses, sharded=communicator.compresses,
                            update_memory=update_memory)
            if hold:
                self._held.append(parcel)
                inner = parcel.pending
            else:
                inner = self._filler.add(parcel, backend, average)
        elif communicator.compresses:
            inner = communicator.start(payload, ctx, name, concrete, backend, average, on_final_payload=update_memory,
                                       owner_memory=self.owner_memory)
        else:
            inner = communicator.start(payload, ctx, name, concrete, backend, average, on_final_payload=update_memory)

        def finish() -> torch.Tensor:
            try:
                arrived = inner()
            except RanksStalled as err:
                raise err.carrying(self._carried_with(name)) from None
            result = self.memory.aggregated(name, arrived)
            # A compressor can overflow finite input (FP16 beyond 65504); the step is skipped then too.
            if not inner.finite:
                self._watch(name, result)
            if self._schedule is not None:
                self._schedule.observe(name, result)
            # Recorded on arrival: a multi-round payload's later rounds are only sent in inner().
            self.record_traffic(name, tensor, inner.bytes_sent, route, inner.wire_bytes, world_size)
            return result

        self._started[name] = inner
        return Pending(finish, inner.bytes_sent)

    def start_whole(self, label: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], names: Sequence[str],
                    backend: Backend, average: bool) -> Pending | None:
        """Compress and launch a caller's fused bucket ``flat`` (1-D; ``tensors``, named ``names``,
        lie back to back in it) as one tensor, where that computes what :meth:`start` of each would,
        bit for bit: an :attr:`~grace_legacy.core.compressor.Compressor.elementwise` compressor,
        no memory and no schedule (nothing kept per tensor), every tensor on the allreduce route.
        One cast of the bucket instead of one per tensor is what PyTorch's ``fp16_compress_hook``
        does; on a fast link the per-tensor work is what a step waits for. The pending result is
        ``flat`` itself, decoded in place; ``None``: start the tensors one by one."""
        self.join_world(backend)
        world_size = backend.size()
        key = (tuple(names), flat.dtype, world_size)
        whole = self._whole.get(key)
        if whole is None:
            whole = self._whole[key] = self._goes_whole(flat, tensors, names, world_size)
        if not whole:
            return None
        payload, ctx = self.compressor.compress(flat, label)
        (part,) = payload
        # The cast is a tensor nobody else holds: a backend that can reduce it in place is given it.
        reduce = backend.allreduce_async if part is flat else \
            getattr(backend, "allreduce_owned_async", backend.allreduce_async)
        handle = reduce(part, f"{label}.r0.0", average)  # the name a one-allreduce bucket's exchange gives
        wire_size = part.element_size()

        def finish() -> torch.Tensor:
            try:
                reduced = backend.wait(handle)
            except RanksStalled as err:
                raise err.carrying(list(names)) from None
            out = self.compressor.decompress_flat(reduced, (ctx,), flat)
            if out is None or out.data_ptr() != flat.data_ptr():
                raise RuntimeError(f"{self.compressor!r} is elementwise but did not decode a flat into its place")
            # A finite sum has only finite terms; otherwise each tensor is looked at alone.
            if not bool(torch.isfinite(flat.sum(dtype=torch.float32 if flat.element_size() < 4 else None))):
                for name, tensor in zip(names, views_of(flat, tensors), strict=True):
                    self._watch(name, tensor)
            rows = self._whole_rows.get(key)  # the key's dtype and the compressor fix the wire size
            if rows is None:  # what record_traffic would count for each tensor (no schedule: no labels)
                rows = self._whole_rows[key] = [
                    (sent, dense, ring_allreduce_bytes(sent, world_size), ring_allreduce_bytes(dense, world_size))
                    for sent, dense in ((t.numel() * wire_size, t.numel() * t.element_size()) for t in tensors)]
            self.traffic.record_each(rows, "allreduce")
            return flat

        pending = Pending(finish, part.numel() * wire_size)
        for name in names:
            self._started[name] = pending
        return pending

    def _goes_whole(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], names: Sequence[str],
                    world_size: int) -> bool:
        """Whether :meth:`start_whole` may send ``flat`` as one tensor (decided from what every rank
        shares: the configuration, the names, shapes and dtypes, the number of ranks)."""
        compressor = self.compressor
        if not (compressor.elementwise and self._schedule is None and type(self.memory) is NoMemory
                and self._flags_from_results and flat.dim() == 1 and flat.is_contiguous()):
            return False
        if sum(t.numel() for t in tensors) != flat.numel():
            return False
        return all(t.numel() and t.dtype == flat.dtype and compressor.compressor_for(t, n) is compressor
                   and self.route_of(compressor, t.shape, t.dtype, world_size) == "allreduce"
                   for t, n in zip(tensors, names, strict=True))

    def launch_held(self, label: str, backend: Backend, average: bool, into: torch.Tensor | None = None) -> None:
        """Launch the tensors started with ``hold=True`` since the last launch as one bucket
        (``label`` names its collectives): a caller with buckets of its own (DDP's) fuses by them.
        ``into``: a 1-D tensor of the tensors' total length, read no more, where their results may
        be decoded back to back (DDP's bucket buffer)."""
        held, self._held = self._held, []
        exchange = launch_bucket(label, held, backend, average, self._held_pool, self.owner_memory, into)
        if exchange is not None and exchange.rounds > 1:
            self._held_flights.append(exchange)

    def holds_later_rounds(self) -> bool:
        """Whether a tensor started with ``hold=True`` and not launched yet needs more than one
        allreduce round (PowerSGD): the same answer on every rank, which shares the configuration."""
        return any(parcel.compressor.rounds > 1 for parcel in self._held)

    def advance_held(self) -> None:
        """Run the later allreduce rounds (PowerSGD's second) of every bucket launched by
        :meth:`launch_held` since the last call, round by round across the buckets in their launch
        order: each bucket's next round is launched as soon as its current one arrived, and travels
        while the other buckets' are computed. The same issue order on every rank."""
        flights, self._held_flights = self._held_flights, []
        while flights:
            flights = [flight for flight in flights if flight.advance()]

    def record_traffic(self, name: str, tensor: torch.Tensor, sent_bytes: int, route: str,
                       wire_bytes: float = 0.0, world_size: int = 1) -> None:
        """Count ``sent_bytes`` handed to the collectives for ``tensor`` and ``wire_bytes`` put on
        the link, against a dense ring allreduce among ``world_size`` ranks (under a schedule's
        labels)."""
        labels = self._schedule.traffic_labels(name, tensor) if self._schedule is not None else None
        dense = tensor.numel() * tensor.element_size()
        self.traffic.record(dense_bytes=dense, sent_bytes=sent_bytes, route=route, wire_bytes=wire_bytes,
                            wire_dense=ring_allreduce_bytes(dense, world_size), labels=labels)

    def _watch(self, name: str, tensor: torch.Tensor) -> None:
        """Remember ``tensor``'s extremes (NaN or infinite exactly when an entry is) for
        :meth:`nonfinite_names`."""
        if tensor.numel():
            self._extremes.setdefault(name, []).extend(torch.aminmax(tensor.detach()))

    def _carried_with(self, name: str) -> list[str]:
        """``name`` and the tensors fused with it."""
        if self._filler is None or name not in self._filler.plan.bucket_of:
            return [name]
        return [name, *(n for n in self._filler.plan.buckets[self._filler.plan.bucket_of[name]] if n != name)]

    def join_world(self, backend: Backend) -> bool:
        """Take this rank's place in ``backend``'s world before sending; ``True`` when the place is
        new (the ranks' agreement should be checked again). A loaded state must be entered at the
        rank and size that saved it (``ValueError``); a change under a running bundle leaves the old
        world as :meth:`rejoin` would (docs/DESIGN.md#elastic-state)."""
        placement = (backend.rank(), backend.size())
        if placement == self._placement:
            return False
        if self._expected_placement is not None and self._expected_placement != placement:
            (rank, size), (saved_rank, saved_size) = placement, self._expected_placement
            raise ValueError(
                f"Grace: this rank ({rank} of {size}) loaded the state that rank {saved_rank} of {saved_size} "
                f"saved; residuals and generators belong to one rank, so each rank must load its own "
                f"(compression.load_state_dict(states[hvd.rank()])) on as many ranks as saved them")
        if self._placement is not None:
            self._leave_world()
        self._placement, self._expected_placement = placement, None
        self.compressor.set_rank(placement[0])
        return True

    # -- elastic training (horovod.elastic; see grace_legacy.elastic) ---------------------------
    def _leave_world(self) -> None:
        self.undo_step()
        if not self.memory.survives_world_change:
            self.memory.reset()
        if self.owner_memory is not None:  # the shards, and so the owners, change with the world
            self.owner_memory.reset()

    def shared_state(self) -> dict[str, Any]:
        """What :meth:`rejoin` takes from the rank every rank follows: the configuration and the
        compressor's state, without the memory's per-rank tensors (nobody else uses them)."""
        return {"config": self.configuration(), "compressor": self.compressor.state_dict()}

    def rejoin(self, shared: dict[str, Any]) -> None:
        """Continue in a changed world from ``shared``, rank 0's :meth:`shared_state`: what every rank
        must agree on comes from it, this process's residuals and byte counts stay
        (docs/DESIGN.md#elastic-state). ``ValueError`` if another configuration saved ``shared``."""
        saved = saved_configuration(shared, "Grace.rejoin")
        refuse_other_configuration("Grace.rejoin", saved, self.configuration())
        own = self.compressor.state_dict()
        self.compressor.load_state_dict(self.compressor.rejoin_state(shared["compressor"], own))
        self._leave_world()
        self._placement = self._expected_placement = None

    # -- the end of a step ------------------------------------------------------------------
    def nonfinite_names(self, names: Sequence[str], backend: Backend) -> set[str]:
        """Which of ``names`` held an inf or NaN on *any* rank this step (in the gradient, its
        compensated form or the result). A collective: every rank passes the same ``names`` in the
        same order (docs/DESIGN.md#skipped-steps)."""
        extremes: list[torch.Tensor] = []
        owners: list[int] = []
        for index, name in enumerate(names):
            found = self._extremes.get(name, ())
            if self._whole_step is not None and name in self._whole_step.flat_of:
                found = self._extremes.get(self._whole_step.flat_of[name], ())
            extremes.extend(found)
            owners.extend([index] * len(found))
        self._extremes.clear()
        if not extremes and self._flags_from_results:
            return set()  # nothing looked non-finite, and no rank's flags need hearing
        flags = torch.zeros(len(names))
        if extremes:
            nonfinite = ~torch.isfinite(torch.stack(extremes))  # stack promotes mixed dtypes exactly
            flags = flags.to(nonfinite.device).index_add_(0, torch.tensor(owners, device=nonfinite.device),
                                                          nonfinite.to(torch.float32))
        summed = flags if self._flags_from_results else \
            backend.wait(backend.allreduce_async(flags, "nonfinite-flags", average=False))
        return {n for n, flagged in zip(names, summed.tolist(), strict=True) if flagged > 0}

    def undo(self, name: str) -> None:
        """Undo this step's changes to ``name``'s memory and compressor state (skipped step)."""
        if self._whole_step is not None:
            name = self._whole_step.flat_of.get(name, name)  # its state is the step's flat's
        self.memory.undo(name)
        self.compressor.undo(name)  # with the state of its segments (ScatterGather's segment names)
        if self.owner_memory is not None:
            self.owner_memory.undo(name)  # the owner's feedback on the segments of ``name``

    def describe(self) -> dict[str, str]:
        """What every rank must agree on, as text (see :mod:`grace_legacy.consistency`)."""
        progress = self._schedule.progress if self._schedule is not None else None
        return {"compressor": repr(self.compressor), "memory": repr(self.memory),
                "communicator": repr(self.communicator), "dense_fallback": str(self.dense_fallback),
                "buckets": (f"{len(self._filler.plan.buckets)} of up to {self.bucket_bytes} bytes "
                            f"(digest {derived_seed(self._filler.plan.buckets):016x})") if self._filler else "none",
                "schedule progress (epochs)": "none" if progress is None else str(progress)}

    def set_epoch(self, epoch: int) -> None:
        """Enter epoch ``epoch``, like ``DistributedSampler.set_epoch`` (schedules change phase)."""
        if self._schedule is not None:
            self._schedule.set_epoch(epoch)

    def unlaunched(self) -> set[str]:
        """The tensors started this step whose collectives this rank has not launched (their
        fused bucket still waits for other members): waiting for those would never end."""
        held = {parcel.name for parcel in self._held}
        if self._whole_step is not None:
            held |= self._whole_step.held()
        return held | self._filler.unlaunched() if self._filler is not None else held

    def undo_step(self) -> None:
        """Forget the step under way (``load_state_dict`` in mid-step, an elastic restore): buckets
        still collecting are emptied and every started tensor is undone as for a skipped step (the
        step counters keep it: its collectives ran). First every collective this rank launched is
        waited for and dropped, so that nothing is in flight under a name the next step uses; an
        error there is the engine's failure, which the step already raised: the wait stops, as
        nothing is in flight any more. Nothing that arrives reaches the memory, schedule or counts."""
        unlaunched = self.unlaunched()
        for name, inner in self._started.items():
            if name not in unlaunched:
                try:
                    inner()
                except Exception:  # noqa: BLE001 (the engine's failure, already raised by the step)
                    break
        if self._filler is not None:
            self._filler.abandon()
        self._held.clear()
        self._held_flights.clear()
        if self._whole_step is not None:
            self._whole_step.abandon()
        for name in self._started:
            self.undo(name)
        self._started.clear()
        self._extremes.clear()

    def end_step(self, backend: Backend | None = None) -> None:
        """Count one synchronized optimizer step (the distributed optimizer calls this)."""
        self._started.clear()
        if self._whole_step is not None:
            self._whole_step.abandon()  # results nobody asked for are not kept into the next step
        self.memory.end_step()
        if self.owner_memory is not None:
            self.owner_memory.end_step()
        self.compressor.end_step(backend)

    @property
    def stats(self) -> dict[str, Any]:
        return self.compressor.stats

    def scalars(self, prefix: str = "grace") -> dict[str, float]:
        """:attr:`stats` as flat numbers for TensorBoard or W&B (:meth:`Compressor.scalars`)."""
        return self.compressor.scalars(prefix)

    def reset_stats(self) -> None:
        self.traffic.reset()

    # -- checkpoints ------------------------------------------------------------------------
    def configuration(self) -> dict[str, str]:
        """What a saved state is only valid for. Not the bucket size: fusion changes which
        collectives carry a tensor, not what is computed."""
        return {"compressor": self.compressor.configuration(), "memory": self.memory.configuration(),
                "communicator": repr(self.communicator), "dense_fallback": str(self.dense_fallback)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state, everything a run carries between steps: the memory's and
        compressor's per-tensor state (residuals, momenta, estimates, the step counters that fix
        every random draw, warm starts), a schedule's position and decisions, the byte counts, the
        :meth:`configuration` and which rank of how many saved it. Plain data, copied
        (``torch.load(..., weights_only=True)`` reads it); call it between steps. It differs from
        rank to rank: gather it, and have each rank load its own (docs/CHECKPOINTING.md). A run
        resumed from it ends bit for bit as the uninterrupted run, given the same data in the same
        order, world size, controller and Horovod settings."""
        placement = self._placement or self._expected_placement
        return {"config": self.configuration(), "placement": None if placement is None else list(placement),
                "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict(),
                "owner_memory": None if self.owner_memory is None else self.owner_memory.state_dict(),
                "traffic": self.traffic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, this rank's :meth:`state_dict` of an earlier run. ``ValueError``
        naming every difference, before changing anything, if another configuration saved it, and
        at the first step if another rank or number of ranks did."""
        saved = saved_configuration(state, "Grace.load_state_dict")
        refuse_other_configuration("Grace.load_state_dict", saved, self.configuration())
        placement = state["placement"]
        self._expected_placement = None if placement is None else (int(placement[0]), int(placement[1]))
        self._placement = None
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        if self.owner_memory is not None:
            self.owner_memory.load_state_dict(state["owner_memory"])
        self.traffic.load_state_dict(state["traffic"])

    def __repr__(self) -> str:
        return f"Grace({self.compressor!r}, memory={self.memory!r}, communicator={self.communicator!r})"


def as_bundle(compression: Compressor | Grace, owner: str) -> Grace:
    """``compression`` as a ``Grace`` bundle: a bundle as it is, a compressor or schedule (``TopK``,
    ``Legacy``, ``Accordion``...) with its recommended memory and the default communicator. Both
    training paths (Horovod's optimizer, the DDP hook) accept the same ``compression`` this way."""
    if isinstance(compression, Grace):
        return compression
    if isinstance(compression, Compressor):
        return Grace(compression)
    raise TypeError(f"{owner}: compression must be a grace_legacy compressor, schedule (Legacy, DGCWarmup, "
                    f"Accordion, LGreCo) or Grace bundle, got {type(compression).__name__}")
