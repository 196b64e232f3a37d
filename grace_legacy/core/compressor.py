"""The compressor interface: a gradient in, a payload (a list of tensors) out, and back."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from grace_legacy.core.knob import Knob
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.core.saved_state import refuse_other_state
from grace_legacy.core.seeds import derived_seed
from grace_legacy.core.stats import TrafficStats

if TYPE_CHECKING:
    from grace_legacy.core.backend import Backend


Payload = list[torch.Tensor]


class Compressor(ABC):
    """Turns a gradient into a small payload and back.

    Subclasses set the class attributes below and implement :meth:`compress` and
    :meth:`decompress`; :meth:`aggregate` combines the payloads of all ranks.

    ``additive``: payloads of all ranks may be summed element-wise by an allreduce *before*
    decompressing, i.e. ``D(sum_r p_r) == sum_r D(p_r)`` and the context is identical on every
    rank. Otherwise the payloads must be gathered.

    ``uniform_payload``: every rank's payload has the same shapes for the same tensor and step,
    so a gather needs no per-rank size header.

    ``lossless``: ``D(C(x)) == x`` exactly, so error feedback has nothing to keep.

    ``sends_entries``: a sparsifier whose payload values are the input's own entries at
    :meth:`support`, copied unscaled, so ``x - D(C(x))`` is ``x`` with those entries set to zero
    (``Residual`` then keeps ``x`` and zeroes them instead of decompressing and subtracting).

    ``delivers_nonfinite``: an inf or NaN in a tensor given to :meth:`compress` is always among what
    is sent, and makes the aggregate non-finite there on every rank (a sum keeps it). Top-k sends
    the largest magnitudes, which NaN and infinity are; a sparsifier that may leave one out (random
    or thresholded entries), or a sign, does not. With a memory that hides none either, every rank
    sees any rank's inf or NaN in the result itself, so the bundle exchanges no flags for it.

    ``aggregates_by_mean``: :meth:`aggregate` is the sum (or mean) of the decompressed payloads,
    so sending the tensor dense is this compressor's exact limit and the bundle may do so when it
    costs fewer bytes. False for majority votes (SignSGD, Signum), whose update a dense mean
    would change.

    ``rounds``: how many allreduces an additive payload needs. After round ``r``'s sum arrives,
    :meth:`next_round` turns it into round ``r + 1``'s local payload (PowerSGD: P, then Q).

    Randomness: stochastic compressors draw from :meth:`generator`, a private generator seeded
    from ``(seed, rank, name, step)``, or (the quantizers, for speed) from counter-based draws of
    the same key (:mod:`grace_legacy.compressors.kernels.draws`); never from the global RNG, so a run is
    reproducible and a test can replay any rank's draws. ``rank`` is set by the bundle that runs
    the compressor.
    """

    knob: ClassVar[Knob | None] = None
    additive: ClassVar[bool] = False
    uniform_payload: ClassVar[bool] = True
    lossless: ClassVar[bool] = False
    sends_entries: ClassVar[bool] = False
    delivers_nonfinite: ClassVar[bool] = False
    aggregates_by_mean: ClassVar[bool] = True
    rounds: ClassVar[int] = 1

    def __init__(self) -> None:
        self._knob_value: Any = None
        self._traffic = TrafficStats()
        # Shared (not copied) by with_knob copies, so a schedule changing the knob keeps counting.
        self._steps: dict[str, int] = {}
        self.rank = 0

    # -- per-tensor steps and randomness ----------------------------------------------------
    def set_rank(self, rank: int) -> None:
        """This process's rank among those it exchanges gradients with."""
        self.rank = rank

    def next_step(self, name: str) -> int:
        """How many times ``name`` was compressed before (0 the first time), then count this one."""
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return step

    def generator(self, seed: int, name: str, step: int, *, per_rank: bool = True,
                  device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator for tensor ``name`` at its ``step``, seeded with :meth:`step_seed`."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.step_seed(seed, name, step, per_rank=per_rank))
        return generator

    def step_seed(self, seed: int, name: str, step: int, *, per_rank: bool = True) -> int:
        """``derived_seed(seed, rank, name, step)``; without ``per_rank``,
        ``derived_seed(seed, name, step)``, so that every rank draws the same numbers."""
        parts = (seed, self.rank, name, step) if per_rank else (seed, name, step)
        return derived_seed(*parts)

    # -- the knob ---------------------------------------------------------------------------
    @property
    def knob_value(self) -> Any:
        return self._knob_value

    def _set_knob(self, value: Any) -> None:
        assert self.knob is not None
        self._knob_value = self.knob.check(value, type(self).__name__)

    def with_knob(self, value: Any) -> Compressor:
        """A copy with its knob set to ``value``. The copy shares this one's per-tensor state
        (step counters, generators), so a schedule that changes the knob does not reset it."""
        if self.knob is None:
            raise ValueError(f"{type(self).__name__} has no parameter to schedule")
        clone = copy.copy(self)
        clone._set_knob(value)
        return clone

    def check_ready(self) -> None:
        """Raise if this compressor cannot be used on its own (its knob was never set)."""
        if self.knob is not None and self._knob_value is None:
            raise ValueError(
                f"{type(self).__name__}() was built without its {self.knob.name}: pass one, e.g. "
                f"{type(self).__name__}({self.knob.name}=...), or wrap it in Legacy(...) which sets it")

    def resolve(self, tensor: torch.Tensor, name: str) -> Compressor | None:
        """The compressor that encodes ``tensor`` now, or ``None`` to send it dense.

        Must depend only on facts every rank shares (shape, name, training progress), so that all
        ranks take the same route for the same tensor.
        """
        self.check_ready()
        if self.knob is not None and self.knob.is_dense(self._knob_value):
            return None
        return self

    # -- training progress (schedules use it; plain compressors ignore it) ---------------------
    # Optional hooks, deliberately empty here: only schedules act on progress.
    def set_epoch(self, epoch: int) -> None:  # noqa: B027
        """Enter epoch ``epoch``, like ``DistributedSampler.set_epoch``."""

    def end_step(self, backend: Backend | None = None) -> None:  # noqa: B027
        """One optimizer step has been synchronized. ``backend`` lets an adaptive schedule agree
        on its decisions across ranks (L-GreCo broadcasts rank 0's)."""

    def observe(self, name: str, aggregated: torch.Tensor) -> None:  # noqa: B027
        """The aggregated gradient of ``name`` this step: the same on every rank, so adaptive
        schedules (Accordion, L-GreCo) can decide from it without disagreeing."""

    # -- encoding ---------------------------------------------------------------------------
    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        """Encode ``tensor``; return (payload, ctx). Only the payload leaves the rank."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Decode one payload into a tensor of the original shape and dtype."""

    def support(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """For sparsifiers: the flat indices whose values ``payload`` carries (the entries DGC's
        factor masking zeroes)."""
        raise NotImplementedError(f"{type(self).__name__} does not send a subset of entries")

    @property
    def sparsifies(self) -> bool:
        """Whether :meth:`support` says which entries a payload carries."""
        return type(self).support is not Compressor.support

    def next_round(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        """For multi-round compressors: the next local payload, given the previous round's sum."""
        raise NotImplementedError(f"{type(self).__name__} sends a single round")

    def end_exchange(self, reduced: Payload, ctx: Any) -> None:  # noqa: B027 (optional hook)
        """For multi-round compressors: the last round's reduced payload, before it is decoded
        (PowerSGD keeps the aggregated Q to warm-start the next step)."""

    def aggregate(self, payloads: Sequence[Payload], ctx: Any, average: bool) -> torch.Tensor:
        """Combine every rank's payload: ``sum_r D(p_r)``, divided by the number of ranks when
        ``average``. Compressors override this for a faster exact sum or another rule (vote)."""
        total = self.decompress(payloads[0], ctx).clone()
        for payload in payloads[1:]:
            total += self.decompress(payload, ctx)
        if average:
            total /= len(payloads)
        return total

    def scatter_context(self, ctx: Any) -> Any | None:
        """For compressors whose :meth:`aggregate` is exactly a scatter-add, rank by rank, of
        payload part 0 (values) at payload part 1 (flat indices) into zeros (Top-k, DGC,
        Threshold): the ``SparseContext`` (shape, size, dtype, device) of the result. A bucket
        then aggregates all such members with one scatter-add. ``None`` (the default):
        aggregate on its own."""
        return None

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """(element count, dtype) of each payload part for a tensor of ``numel`` elements, as
        configured now; used to predict bytes (budget matching) without compressing anything."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its payload size")

    def payload_spec_for(self, shape: torch.Size, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """:meth:`payload_spec` for a tensor of this shape; override where the shape matters."""
        return self.payload_spec(shape.numel(), dtype)

    # -- bookkeeping ------------------------------------------------------------------------
    def record_traffic(self, name: str, tensor: torch.Tensor, sent_bytes: int, route: str) -> None:
        self._traffic.record(dense_bytes=tensor.numel() * tensor.element_size(),
                             sent_bytes=sent_bytes, route=route)

    @property
    def stats(self) -> dict[str, Any]:
        """Bytes this rank handed to collectives so far, vs a dense send of the same tensors."""
        return self._traffic.as_dict()

    def reset_stats(self) -> None:
        self._traffic.reset()

    # -- skipped steps -----------------------------------------------------------------------
    def rollback(self, name: str) -> None:
        """Undo this step's change to ``name``'s state: some rank's gradient was not finite, so
        the step will be skipped (``GradScaler``) and must leave no trace."""
        journal = self.__dict__.get("_journal")
        if journal is not None:
            journal.rollback(name)

    def commit(self) -> None:
        """The step is over: what :meth:`rollback` would restore can be let go."""
        journal = self.__dict__.get("_journal")
        if journal is not None:
            journal.commit()

    # -- checkpoints ------------------------------------------------------------------------
    def configuration(self) -> str:
        """What a saved state is only valid for: this compressor's arguments, as its ``repr``
        (schedules leave out the decisions they take while training)."""
        return repr(self)

    def state_dict(self) -> dict[str, Any]:
        """Everything this compressor carries from step to step, as plain data (tensors, numbers,
        strings, lists and dicts: ``torch.load(..., weights_only=True)`` reads it back): its
        :meth:`configuration`, byte counts, and per-tensor step counters, which with the seed and
        the rank *are* the state of every random generator it draws from (:meth:`generator`).
        Subclasses add what else they keep (PowerSGD's warm start, Signum's momentum, a
        schedule's progress). Tensors are copies. See :meth:`grace_legacy.Grace.state_dict` for
        checkpointing a whole run."""
        return {"config": self.configuration(), "traffic": self._traffic.state_dict(), "steps": dict(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a compressor configured alike; a
        ``ValueError`` names what differs otherwise). Call between steps."""
        owner = f"{type(self).__name__}.load_state_dict"
        refuse_other_state(state, owner, self.configuration())
        self.commit()
        self._traffic.load_state_dict(state["traffic"])
        # Update in place: with_knob copies share this dict.
        self._steps.clear()
        self._steps.update(state["steps"])

    def rejoin_state(self, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        """The state to continue from after the world changed (elastic training: a rank lost or
        added), given ``shared``, the :meth:`state_dict` of the rank every rank follows (rank 0),
        and ``own``, this rank's (a newcomer's is fresh). What every rank must agree on comes
        from ``shared``: the per-tensor step counters, which with the seed make every generator
        (Random-k draws the same indices on every rank only from equal counters). What this
        rank alone measured stays its own: its byte counts. Subclasses that keep per-rank state
        (Signum's momentum of its own gradients) keep theirs from ``own`` too."""
        return {**shared, "traffic": own["traffic"]}

    def recommended_memory(self) -> Memory:
        """The memory GRACE pairs with this compressor when the user names none."""
        return NoMemory()

    def check_memory(self, memory: Memory) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` if this compressor cannot work with ``memory``."""

    def __repr__(self) -> str:
        if self.knob is None:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}({self.knob.name}={self._knob_value!r})"
