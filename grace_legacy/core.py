"""The three GRACE interfaces (compressor, memory, communicator) and the backend they talk to.

Data flows one way through a training step, for every gradient tensor ``g`` named ``name``:

    compensated = memory.compensate(g, name)            # e.g. g + e  (error feedback)
    c           = compressor.resolve(compensated, name) # which concrete compressor acts now
    payload, ctx = c.compress(compensated, name)         # list of tensors + rank-local context
    memory.update(compensated, name, c, payload, ctx)    # e.g. e <- compensated - D(payload)
    pending     = communicator.start(payload, ctx, name, c, backend, average)
    g_sync      = pending()                              # waits, then aggregates

``payload`` is the only thing that leaves the rank; ``ctx`` never does. A compressor knows nothing
of Horovod, a communicator knows a compressor only through ``decompress``/``aggregate``, and a
backend moves tensors without knowing what they mean.
"""

from __future__ import annotations

import copy
import hashlib
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from grace_legacy.stats import TrafficStats

Payload = list[torch.Tensor]

_UNSET: Any = object()


@dataclass(frozen=True)
class Knob:
    """The one parameter of a compressor that LEGACY schedules.

    ``low``/``high`` bound the accepted range (``None`` = unbounded), ``integer`` asks for whole
    numbers, and ``dense`` is the value that means "send this tensor uncompressed" (``None``
    always means that too).
    """

    name: str
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    integer: bool = False
    dense: Any = None

    def describe_range(self) -> str:
        if self.integer and self.high is None and self.low is not None:
            return f"an integer >= {int(self.low)}"
        show = (lambda v: str(int(v))) if self.integer else (lambda v: f"{v:g}")
        left = ("[" if self.low_inclusive else "(") + ("-inf" if self.low is None else show(self.low))
        right = ("inf" if self.high is None else show(self.high)) + ("]" if self.high_inclusive else ")")
        kind = "an integer" if self.integer else "a number"
        return f"{kind} in {left}, {right}"

    def check(self, value: Any, owner: str) -> Any:
        """Return ``value`` if it is valid for this knob, else raise naming ``owner``'s argument."""
        if value is None:
            return None
        where = f"{owner}: {self.name}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where} must be {self.describe_range()}, got {value!r} "
                            f"of type {type(value).__name__}")
        if isinstance(value, torch.Tensor):  # a 0-dim tensor is a Real only by accident
            raise TypeError(f"{where} must be a Python number, got a tensor")
        if isinstance(value, numbers.Integral):
            # Exact: float() of an int beyond ~1.8e308 raises OverflowError, not a clear ValueError.
            value = int(value)
            if not self.integer:
                value = _finite_float(value, where, self)
        else:
            given = value
            # A Fraction's float can round onto an integer (2**52 + 1/2 does): judge it exactly.
            fractional = isinstance(given, numbers.Rational) and given.denominator != 1
            value = _finite_float(given, where, self)
            if self.integer:
                if fractional or not value.is_integer():
                    raise ValueError(f"{where} must be {self.describe_range()}, got {given!r}")
                value = int(given) if isinstance(given, numbers.Rational) else int(value)
        too_low = self.low is not None and (value < self.low or (value == self.low and not self.low_inclusive))
        too_high = self.high is not None and (value > self.high or (value == self.high and not self.high_inclusive))
        if too_low or too_high:
            raise ValueError(f"{where} must be {self.describe_range()}, got {value!r}")
        return value

    def is_dense(self, value: Any) -> bool:
        return value is None or (self.dense is not None and value == self.dense)


def _finite_float(value: numbers.Real, where: str, knob: Knob) -> float:
    """``value`` as a finite float, or a ``ValueError`` naming the knob's range."""
    try:
        converted = float(value)
    except OverflowError:  # an int or Fraction too large for a float
        converted = math.inf
    if not math.isfinite(converted):
        raise ValueError(f"{where} must be {knob.describe_range()}, got {value!r}")
    return converted


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from any values, the same in every process (unlike Python's ``hash``)."""
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


_ABSENT = object()


class StepJournal:
    """What per-tensor state held before this step changed it, so that a skipped step (a
    non-finite gradient on some rank) can be undone exactly.

    Call :meth:`remember` before replacing ``store[name]``. Only references are kept, which is
    sound because state is replaced out of place, never written into, and only until
    :meth:`commit` at the end of the step: the cost is at most one extra copy of the state while
    a step is in flight. A compressor or memory that owns ``self._journal`` gets working
    ``rollback``/``commit`` from its base class.
    """

    def __init__(self) -> None:
        self._before: dict[tuple[int, str], tuple[dict, Any]] = {}

    def remember(self, store: dict, name: str) -> None:
        self._before.setdefault((id(store), name), (store, store.get(name, _ABSENT)))

    def rollback(self, name: str) -> None:
        for key in [key for key in self._before if key[1] == name]:
            store, previous = self._before.pop(key)
            if previous is _ABSENT:
                store.pop(name, None)
            else:
                store[name] = previous

    def commit(self) -> None:
        self._before.clear()


_SEPARATORS = " ,()[]{}"


def _first_difference(saved: str, now: str) -> str:
    """The argument where two configuration strings first differ, e.g. ``'epochs=4' -> 'epochs=8'``."""
    start = 0
    while start < min(len(saved), len(now)) and saved[start] == now[start]:
        start += 1
    while start > 0 and saved[start - 1] not in _SEPARATORS:
        start -= 1

    def token(text: str) -> str:
        end = start
        while end < len(text) and (end == start or text[end] not in _SEPARATORS):
            end += 1
        return text[start:end]

    return f"{token(saved)!r} -> {token(now)!r}"


def refuse_other_configuration(owner: str, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every entry of a saved configuration that differs from ``now``.

    A state is only meaningful for the set-up that produced it: a residual kept for Top-k at
    density 0.01, or a step counter of QSGD with seed 7, loaded into another set-up would resume
    a run that never happened, silently.
    """
    lines = []
    for key in sorted(set(saved) | set(now)):
        before, after = saved.get(key, "<missing>"), now.get(key, "<missing>")
        if before != after:
            where = f" (at {_first_difference(before, after)})" if isinstance(before, str) and isinstance(
                after, str) else ""
            lines.append(f"  {key}: saved {before}, now {after}{where}")
    if lines:
        raise ValueError(f"{owner}: this state was saved by a different configuration; loading it would "
                         f"resume a run that never happened:\n" + "\n".join(lines))


def saved_configuration(state: Any, owner: str) -> Any:
    """``state["config"]``, or a ``ValueError`` saying the object is not such a state."""
    if not isinstance(state, Mapping) or "config" not in state:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{owner}: expected a state from {owner.split('.')[0]}.state_dict() (a dict with a "
                         f"'config' entry), got {got}")
    return state["config"]


def refuse_other_state(state: Any, owner: str, configuration: str) -> None:
    """A ``ValueError`` unless ``state`` is a state saved under ``configuration`` (a compressor's or
    a memory's, which is one string)."""
    refuse_other_configuration(owner, {"config": saved_configuration(state, owner)}, {"config": configuration})


#: The gradient dtypes every compressor encodes. float8 types are floating point too, but
#: PyTorch implements too few operations on them (abs, topk, norms) for any compressor.
GRADIENT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` by Python's convention, and a ``ValueError``
    like every other invalid argument, so that either ``except`` catches it."""


def check_gradient(tensor: torch.Tensor, owner: str) -> None:
    """Reject what no compressor can encode, with an error that says what was wrong."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{owner}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{owner}: gradients must be floating point, got dtype {tensor.dtype}")
    if tensor.dtype not in GRADIENT_DTYPES:
        raise TypeError(f"{owner}: gradients must be float32, float64, float16 or bfloat16, got {tensor.dtype}")
    if tensor.numel() == 0:
        raise ValueError(f"{owner}: cannot compress an empty tensor (shape {tuple(tensor.shape)})")
    if tensor.is_sparse:
        raise TypeError(f"{owner}: sparse tensors are not supported; densify the gradient first")


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: whether ``tensor`` holds an inf or a NaN (``False`` when empty).

    The same answer as ``~torch.isfinite(tensor).all()``, from one ``aminmax`` pass instead of a
    bool temporary of the tensor's size: the minimum and maximum are NaN if any entry is (both
    propagate NaN) and infinite if an infinity is the extreme, and they cannot overflow. The flag
    stays a tensor, so asking costs no synchronization.
    """
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor.detach())
    return ~(torch.isfinite(low) & torch.isfinite(high))


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

    ``aggregates_by_mean``: :meth:`aggregate` is the sum (or mean) of the decompressed payloads,
    so sending the tensor dense is this compressor's exact limit and the bundle may do so when it
    costs fewer bytes. False for majority votes (SignSGD, Signum), whose update a dense mean
    would change.

    ``rounds``: how many allreduces an additive payload needs. After round ``r``'s sum arrives,
    :meth:`next_round` turns it into round ``r + 1``'s local payload (PowerSGD: P, then Q).

    Randomness: stochastic compressors draw from :meth:`generator`, a private generator seeded
    from ``(seed, rank, name, step)``, or (the quantizers, for speed) from counter-based draws of
    the same key (:mod:`grace_legacy.compressors.draws`); never from the global RNG, so a run is
    reproducible and a test can replay any rank's draws. ``rank`` is set by the bundle that runs
    the compressor.
    """

    knob: ClassVar[Knob | None] = None
    additive: ClassVar[bool] = False
    uniform_payload: ClassVar[bool] = True
    lossless: ClassVar[bool] = False
    sends_entries: ClassVar[bool] = False
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

    def recommended_memory(self) -> Memory:
        """The memory GRACE pairs with this compressor when the user names none."""
        from grace_legacy.memories import NoMemory

        return NoMemory()

    def check_memory(self, memory: Memory) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` if this compressor cannot work with ``memory``."""

    def __repr__(self) -> str:
        if self.knob is None:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}({self.knob.name}={self._knob_value!r})"


class Memory(ABC):
    """Per-tensor state carried between steps (error feedback and its relatives).

    ``keeps_nonfinite``: an inf or NaN in the tensor given to :meth:`compensate` is still one in
    what it returns (an element-wise sum with finite or non-finite state does that), so the
    bundle need only look at the compensated gradient to flag a step.
    """

    keeps_nonfinite: ClassVar[bool] = False

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return what should be compressed this step, e.g. ``g + e``."""

    @abstractmethod
    def update(self, compensated: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        """Learn from what was actually sent, e.g. ``e <- compensated - D(payload)``."""

    def check_compressor(self, compressor: Compressor) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` if this memory cannot work with ``compressor``."""

    def aggregated(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The gradient to apply, given the aggregate of what all ranks sent. The identity for
        error feedback; EF21 adds the aggregate to its running estimate of the gradient."""
        return tensor

    def rollback(self, name: str) -> None:
        """Undo this step's update of ``name`` (the step will be skipped: some rank's gradient
        was not finite). Memories with state keep a ``self._journal`` (:class:`StepJournal`)."""
        journal = self.__dict__.get("_journal")
        if journal is not None:
            journal.rollback(name)
        elif set(self.state_dict()) - {"config"}:
            raise NotImplementedError(f"{type(self).__name__} keeps state but no StepJournal to roll a step back")

    def commit(self) -> None:
        """The step is over: what :meth:`rollback` would restore can be let go."""
        journal = self.__dict__.get("_journal")
        if journal is not None:
            journal.commit()

    def configuration(self) -> str:
        """What a saved state is only valid for: this memory's arguments, as its ``repr``."""
        return repr(self)

    def state_dict(self) -> dict[str, Any]:
        """The per-tensor state (copies) and the :meth:`configuration` it belongs to. Subclasses
        add their tensors to ``super().state_dict()``."""
        return {"config": self.configuration()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that ``state`` was saved by a memory configured alike (``ValueError`` naming the
        difference otherwise); subclasses then load their tensors. Call between steps."""
        owner = f"{type(self).__name__}.load_state_dict"
        refuse_other_state(state, owner, self.configuration())
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(f"{owner}: the state holds {sorted(unknown)}, which {type(self).__name__} does not keep")
        self.commit()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Backend(Protocol):
    """What a communicator needs from a collective library (Horovod, later others)."""

    def rank(self) -> int: ...
    def size(self) -> int: ...
    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> Any: ...
    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any: ...
    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> Any: ...
    def wait(self, handle: Any) -> torch.Tensor: ...


class Pending:
    """A gradient on its way: ``pending()`` waits for the collectives and returns the result.

    ``bytes_sent`` is the size of what this rank handed to the backend.
    """

    __slots__ = ("bytes_sent", "_finish", "_result")

    def __init__(self, finish: Callable[[], torch.Tensor], bytes_sent: int) -> None:
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None
        self.bytes_sent = bytes_sent

    def __call__(self) -> torch.Tensor:
        if self._finish is not None:
            self._result = self._finish()
            self._finish = None
        assert self._result is not None
        return self._result


class Communicator(ABC):
    """Moves payloads between ranks and turns them into the aggregated gradient."""

    #: False for communicators that sum payloads and so cannot carry indices, signs or codes.
    carries_non_additive: ClassVar[bool] = True
    #: The label byte accounting files this communicator's traffic under.
    route: ClassVar[str]
    #: Whether the bundle may send this communicator's tensors in fused buckets instead.
    fusable: ClassVar[bool] = False

    @abstractmethod
    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Callable[[Payload, Any], None] | None = None) -> Pending:
        """Launch the collectives for one tensor without waiting for them.

        ``on_final_payload(payload, ctx)`` is called with the last round's *local* payload once it
        exists (at once for single-round compressors): error feedback learns from it.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
