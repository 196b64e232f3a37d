"""The ``Grace`` bundle: one compressor, one memory, one communicator, run for every tensor."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from grace_legacy.communicators import Allgather, Allreduce
from grace_legacy.communicators.flight import Member
from grace_legacy.communicators.fusion import BucketPlan, FusedExchange, default_bucket_bytes
from grace_legacy.compressors import NoCompression
from grace_legacy.core import wire
from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.cost import gather_costs_more
from grace_legacy.core.memory import Memory
from grace_legacy.core.saved_state import refuse_other_configuration, saved_configuration
from grace_legacy.core.seeds import derived_seed
from grace_legacy.core.stall import RanksStalled, resolve_stall_timeout
from grace_legacy.core.validation import ArgumentTypeError, check_flag, is_int

_DENSE = NoCompression()


_ALLREDUCE = Allreduce()


_ALLGATHER = Allgather()


class Grace:
    """Compressor + memory + communicator, as in GRACE (Xu et al., 2021).

    ``memory=None`` takes the compressor's recommended memory (``Residual`` for sparsifiers,
    ``NoMemory`` otherwise). ``communicator=None`` picks, per tensor, what its payload needs: an
    allreduce for additive payloads and an allgather for everything else. A tensor the compressor
    leaves uncompressed (``resolve`` returns ``None``: density 1.0, a LEGACY ``None`` value, an
    empty tensor) always takes a plain dense allreduce and leaves no residual behind.

    Passing a ``Grace`` (or a bare compressor) as ``compression=`` to
    ``hvd.DistributedOptimizer`` runs it on every gradient; ``.stats`` reports the bytes sent.

    ``dense_fallback`` (default on): a tensor whose gathered payload would move at least as many
    bytes as a ring allreduce of the dense tensor (:func:`gather_costs_more`) is sent dense
    instead, recorded under the route ``"dense-fallback"``. Only payloads whose size every rank
    can predict from the shape take part (not Threshold's), so all ranks decide alike, and only
    compressors whose aggregate is a mean (not SignSGD's vote, which a dense mean would change).

    ``bucket_bytes``: tensors are sent in fused buckets of up to this many dense bytes, one
    collective per kind per bucket (:mod:`grace_legacy.communicators.fusion`), once
    :meth:`plan_buckets` has been told the tensors (``hvd.DistributedOptimizer`` does). ``None``
    takes :func:`default_bucket_bytes`: ``HOROVOD_FUSION_THRESHOLD`` as Horovod reads it, at most
    16 MiB; ``0`` sends every tensor on its own. A communicator that cannot be fused
    (``Broadcast``) always sends per tensor.

    ``stall_timeout``: seconds a rank waits for one collective before it raises
    :class:`~grace_legacy.core.stall.RanksStalled`, naming the gradient and the ranks it waits for
    (a rank stopped or hung without dying would otherwise keep the others waiting forever).
    ``None`` takes ``GRACE_LEGACY_STALL_TIMEOUT`` from the environment, else 1800 s
    (:data:`~grace_legacy.core.stall.DEFAULT_STALL_TIMEOUT_S`).
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
        self._fusion: FusedExchange | None = None
        self._gather_cost: dict[tuple, bool] = {}
        self.compressor = compressor
        self.memory = memory if memory is not None else compressor.recommended_memory()
        compressor.check_memory(self.memory)
        self.memory.check_compressor(compressor)
        self.communicator = communicator
        # Whether each rank can tell on its own which tensors held an inf or NaN on some rank: when
        # the compressor sends every one it is given (its dense routes do too), and the memory
        # neither hides one nor changes the result, any rank's inf or NaN is in every rank's
        # result, and the results are identical on every rank. Fixed by the configuration, which
        # every rank shares (the consistency check sees to it), so all ranks skip the flags'
        # allreduce alike.
        self._flags_from_results = (compressor.delivers_nonfinite and self.memory.keeps_nonfinite
                                    and type(self.memory).aggregated is Memory.aggregated)
        # Per tensor of the current step: the extremes (0-dim tensors) of this rank's gradient,
        # what its memory made of it and the synchronized result; any of them inf or NaN means
        # the tensor held one. Only looked at, all at once, in nonfinite_names: a check per tensor
        # would cost several small tensor operations each.
        self._extremes: dict[str, list[torch.Tensor]] = {}
        # The tensors started in the current step (what abandon_step rolls back).
        self._started: set[str] = set()
        # (rank, size) of the process set this bundle ran on, and the one a loaded state expects.
        self._placement: tuple[int, int] | None = None
        self._expected_placement: tuple[int, int] | None = None

    def plan_buckets(self, sizes: Sequence[tuple[str, int]]) -> None:
        """Fuse the tensors named in ``sizes`` ((name, dense bytes), in expected arrival order)
        into buckets of up to :attr:`bucket_bytes`. Every rank must give the same list."""
        fusable = self.communicator is None or self.communicator.fusable
        self._fusion = FusedExchange(BucketPlan(sizes, self.bucket_bytes)) if fusable and self.bucket_bytes else None

    def _gathers_more_than_dense(self, concrete: Compressor, tensor: torch.Tensor, world_size: int) -> bool:
        key = (id(concrete), tensor.shape, tensor.dtype, world_size)
        verdict = self._gather_cost.get(key)
        if verdict is None:
            try:
                packed = wire.packed_size_of(concrete.payload_spec_for(tensor.shape, tensor.dtype),
                                             with_header=not concrete.uniform_payload)
            except NotImplementedError:  # a size only the data decides: ranks could disagree
                verdict = False
            else:
                verdict = gather_costs_more(packed, tensor.numel() * tensor.element_size(), world_size)
            self._gather_cost[key] = verdict
        return verdict

    def start(self, tensor: torch.Tensor, name: str, backend: Backend, average: bool,
              overwrite: bool = False) -> Pending:
        """Compress ``tensor`` and launch its collectives; call the result to get the gradient.

        ``overwrite``: the caller will not read ``tensor`` again, so the memory may build the
        compensated gradient in its storage (:meth:`Memory.compensate_into`)."""
        self.enter(backend)
        # A sparsifier or a sign may drop an inf; the flag makes sure every rank still sees it.
        # Finite state can still overflow (momentum, an fp16 sum), so the compensated gradient is
        # always looked at; the raw one too (first: compensate may write over it) unless the
        # memory keeps its infs and NaNs.
        self._extremes[name] = []
        watch = not self._flags_from_results  # else the result will show it
        if watch and not self.memory.keeps_nonfinite:
            self._watch(name, tensor)
        compensated = (self.memory.compensate_into if overwrite else self.memory.compensate)(tensor, name)
        if watch and (compensated is not tensor or self.memory.keeps_nonfinite):
            self._watch(name, compensated)
        concrete = self.compressor.resolve(compensated, name) if tensor.numel() else None
        route = "dense"
        if concrete is not None:
            gathered = self.communicator.carries_non_additive if self.communicator else not concrete.additive
            if (gathered and self.dense_fallback and concrete.aggregates_by_mean
                    and self._gathers_more_than_dense(concrete, tensor, backend.size())):
                concrete, route = None, "dense-fallback"
        if concrete is None:
            # Dense: the compensated gradient itself, so a residual left from compressed steps is
            # delivered now rather than lost.
            concrete, payload, ctx, communicator = _DENSE, [compensated], None, _ALLREDUCE
        else:
            payload, ctx = concrete.compress(compensated, name)
            communicator = self.communicator or (_ALLREDUCE if concrete.additive else _ALLGATHER)
            route = communicator.route

        def learn(final_payload: Payload, final_ctx: Any) -> None:
            self.memory.update(compensated, name, concrete, final_payload, final_ctx)

        if self._fusion is not None and name in self._fusion.plan.bucket_of:
            member = Member(name, payload, ctx, concrete, gathered=communicator.carries_non_additive, learn=learn)
            inner = self._fusion.add(member, backend, average)
        else:
            inner = communicator.start(payload, ctx, name, concrete, backend, average, on_final_payload=learn)

        def finish() -> torch.Tensor:
            try:
                arrived = inner()
            except RanksStalled as err:
                raise err.carrying(self._carried_with(name)) from None
            result = self.memory.aggregated(name, arrived)
            # A compressor can overflow finite input (FP16 beyond 65504); the step is skipped then too.
            if not inner.finite:
                self._watch(name, result)
            self.compressor.observe(name, result)
            # Recorded on arrival: a multi-round payload's later rounds are only sent in inner().
            self.compressor.record_traffic(name, tensor, inner.bytes_sent, route)
            return result

        self._started.add(name)
        return Pending(finish, inner.bytes_sent)

    def _watch(self, name: str, tensor: torch.Tensor) -> None:
        """Remember ``tensor``'s extremes for :meth:`nonfinite_names`: the minimum and maximum are
        NaN if any entry is (both propagate NaN) and infinite if an infinity is the extreme, and
        they cannot overflow; one pass, no temporary of the tensor's size."""
        if tensor.numel():
            self._extremes.setdefault(name, []).extend(torch.aminmax(tensor.detach()))

    def _carried_with(self, name: str) -> list[str]:
        """``name`` and the tensors fused with it."""
        if self._fusion is None or name not in self._fusion.plan.bucket_of:
            return [name]
        return [name, *(n for n in self._fusion.plan.buckets[self._fusion.plan.bucket_of[name]] if n != name)]

    def enter(self, backend: Backend) -> bool:
        """Take this rank's place in ``backend``'s world before sending: ``True`` when the place
        is new (the first step, or the first since the world changed), when whoever runs the
        bundle should check again that the ranks agree (the distributed optimizer does).

        A loaded state must be entered at the rank and size that saved it (``ValueError``
        otherwise). A rank or size that changes under a running bundle is an elastic reset that
        Horovod did not follow with a synchronization (it skips one when ranks only left): the
        bundle then leaves the old world as :meth:`rejoin` would, keeping rank 0's shared state
        that every survivor already holds, and every rank sees the change alike."""
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
        self.abandon_step()
        if not self.memory.survives_world_change:
            self.memory.forget()

    def shared_state(self) -> dict[str, Any]:
        """What :meth:`rejoin` takes from the rank every rank follows: the configuration and the
        compressor's state, without the memory's per-rank tensors (nobody else uses them)."""
        return {"config": self.configuration(), "compressor": self.compressor.state_dict()}

    def rejoin(self, shared: dict[str, Any]) -> None:
        """Continue in a world that changed (ranks left or joined; elastic training) from
        ``shared``, the :meth:`shared_state` of the rank that every rank follows (rank 0).

        What every rank must agree on is taken from ``shared``: the schedule's progress and
        decisions, the step counters that seed every generator, PowerSGD's warm start
        (:meth:`Compressor.rejoin_state`). What is this process's own is kept: its error-feedback
        residuals, so a survivor still delivers the gradient it has not sent yet (a newcomer's
        are empty), and its byte counts. A memory whose state is a function of the whole world
        (EF21's estimate of the mean; ``Memory.survives_world_change``) starts afresh on every
        rank. The next :meth:`enter` takes the new rank and size wherever they are.
        Raises ``ValueError`` if ``shared`` was saved by another configuration."""
        saved = saved_configuration(shared, "Grace.rejoin")
        refuse_other_configuration("Grace.rejoin", saved, self.configuration())
        own = self.compressor.state_dict()
        self.compressor.load_state_dict(self.compressor.rejoin_state(shared["compressor"], own))
        self._leave_world()
        self._placement = self._expected_placement = None

    # -- the end of a step ------------------------------------------------------------------
    def nonfinite_names(self, names: Sequence[str], backend: Backend) -> set[str]:
        """Which of ``names`` held an inf or NaN on *any* rank this step: one small allreduce of
        one flag per name, or none where each rank's results show it (see ``delivers_nonfinite``
        in :class:`~grace_legacy.core.compressor.Compressor`). Every rank must pass the same
        ``names`` in the same order."""
        extremes: list[torch.Tensor] = []
        owners: list[int] = []
        for index, name in enumerate(names):
            found = self._extremes.get(name, ())
            extremes.extend(found)
            owners.extend([index] * len(found))
        self._extremes.clear()
        flags = torch.zeros(len(names))
        if extremes:
            nonfinite = ~torch.isfinite(torch.stack(extremes))  # stack promotes mixed dtypes exactly
            flags = flags.to(nonfinite.device).index_add_(0, torch.tensor(owners, device=nonfinite.device),
                                                          nonfinite.to(torch.float32))
        summed = flags if self._flags_from_results else \
            backend.wait(backend.allreduce_async(flags, "nonfinite-flags", average=False))
        return {n for n, flagged in zip(names, summed.tolist(), strict=True) if flagged > 0}

    def discard(self, name: str) -> None:
        """Undo this step's changes to ``name``'s memory and compressor state (skipped step)."""
        self.memory.rollback(name)
        self.compressor.rollback(name)

    def describe(self) -> dict[str, str]:
        """What every rank must agree on, as text (see :mod:`grace_legacy.consistency`)."""
        progress = getattr(self.compressor, "progress", None)
        return {"compressor": repr(self.compressor), "memory": repr(self.memory),
                "communicator": repr(self.communicator), "dense_fallback": str(self.dense_fallback),
                "buckets": (f"{len(self._fusion.plan.buckets)} of up to {self.bucket_bytes} bytes "
                            f"(digest {derived_seed(self._fusion.plan.buckets):016x})") if self._fusion else "none",
                "schedule progress (epochs)": "none" if progress is None else str(progress)}

    def set_epoch(self, epoch: int) -> None:
        """Enter epoch ``epoch``, like ``DistributedSampler.set_epoch`` (schedules change phase)."""
        self.compressor.set_epoch(epoch)

    def unlaunched(self) -> set[str]:
        """The tensors started this step whose collectives this rank has not launched (their
        fused bucket still waits for other members): waiting for those would never end."""
        return self._fusion.unlaunched() if self._fusion is not None else set()

    def abandon_step(self) -> None:
        """Forget the step under way as if it had not begun: the distributed optimizer calls this
        when Horovod drops its pending gradients (``load_state_dict`` in mid-step). Buckets still
        collecting members are emptied, and every started tensor's memory and compressor state is
        rolled back to the end of the last step, as for a skipped step (:meth:`discard`: the byte
        counts and the per-tensor step counters that seed random draws keep the dropped step,
        whose collectives did run). The caller first waits for the collectives this rank launched
        (:meth:`unlaunched` tells which it did not), so that none of them is still in flight under
        a name the next step uses again."""
        if self._fusion is not None:
            self._fusion.abandon()
        for name in self._started:
            self.discard(name)
        self._started.clear()
        self._extremes.clear()

    def end_step(self, backend: Backend | None = None) -> None:
        """Count one synchronized optimizer step (the distributed optimizer calls this)."""
        self._started.clear()
        self.memory.commit()
        self.compressor.commit()
        self.compressor.end_step(backend)

    @property
    def stats(self) -> dict[str, Any]:
        return self.compressor.stats

    def reset_stats(self) -> None:
        self.compressor.reset_stats()

    # -- checkpoints ------------------------------------------------------------------------
    def configuration(self) -> dict[str, str]:
        """What a saved state is only valid for. Not the bucket size: fusion changes which
        collectives carry a tensor, not what is computed."""
        return {"compressor": self.compressor.configuration(), "memory": self.memory.configuration(),
                "communicator": repr(self.communicator), "dense_fallback": str(self.dense_fallback)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state, so that a run resumed from a checkpoint continues
        bit for bit as if it had never stopped: the memory's per-tensor state (residuals, DGC's
        momenta, EF21's estimates), the compressor's (step counters, which fix every random
        draw; PowerSGD's warm start; Signum's momentum), a schedule's position and decisions, the
        byte counts of :attr:`stats`, the :meth:`configuration`, and which rank of how many saved
        it. Plain data, copied: ``torch.save`` it, and ``torch.load(..., weights_only=True)``
        reads it back. Call it between steps.

        The state differs from rank to rank (each rank has its own residuals and draws), so
        gather it; the model and optimizer are the same on every rank::

            states = hvd.allgather_object(compression.state_dict())
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "compression": states, "epoch": epoch}, path)

        and to resume, in fresh processes, on as many ranks, after building everything as before::

            checkpoint = torch.load(path, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            compression.load_state_dict(checkpoint["compression"][hvd.rank()])

        (with ``torch.amp.GradScaler``, save and load ``scaler.state_dict()`` too). The resumed
        run's parameters then equal the uninterrupted run's bit for bit, given the same data in
        the same order, the same world size and controller, and Horovod's settings unchanged.
        """
        placement = self._placement or self._expected_placement
        return {"config": self.configuration(), "placement": None if placement is None else list(placement),
                "compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, this rank's :meth:`state_dict` of an earlier run.

        Raises ``ValueError`` naming every difference if the state was saved by another
        configuration (compressor, schedule, memory, communicator or their arguments), before
        changing anything; and at the first step if it was saved by another rank, or on another
        number of ranks."""
        saved = saved_configuration(state, "Grace.load_state_dict")
        refuse_other_configuration("Grace.load_state_dict", saved, self.configuration())
        placement = state["placement"]
        self._expected_placement = None if placement is None else (int(placement[0]), int(placement[1]))
        self._placement = None
        self.compressor.load_state_dict(state["compressor"])
        self.memory.load_state_dict(state["memory"])

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
