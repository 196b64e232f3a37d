"""The compressor interface: a gradient in, a payload (a list of tensors) out, and back."""

from __future__ import annotations

import copy
import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.seeds import derived_seed
from grace_legacy.core.state import Stateful
from grace_legacy.core.traits import NAMES, NEEDS, Traits

Payload = list[torch.Tensor]


class Compressor(Stateful, ABC):
    """Turns a gradient into a payload (a list of tensors, the only thing sent) and back. Subclasses
    implement :meth:`compress`, :meth:`decompress` and :meth:`payload_spec` and describe their payload
    by :attr:`parameter` and :attr:`traits` (the contract: docs/IMPLEMENTING.md). What only some
    compressors do is opt-in, mixed in below: a parameter a schedule sets (:class:`Tunable`),
    sending some of the input's entries (:class:`Sparsifier`), drawing random numbers
    (:class:`Randomized`), several allreduce rounds (:class:`MultiRound`), a fused bucket decoded
    whole (:class:`Elementwise`)."""

    #: the one parameter a schedule may set (a :class:`Tunable`'s), or None
    parameter: ClassVar[ScheduledParameter | None] = None
    #: what its payload allows (grace_legacy/core/traits.py), checked when a subclass is made
    traits: ClassVar[Traits] = Traits()
    #: this process's rank, until the bundle sets it (:meth:`set_rank`)
    rank: int = 0

    def __init__(self) -> None:
        super().__init__()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        stale = [name for name in NAMES if name in cls.__dict__]
        if stale:
            raise TypeError(f"{cls.__name__}: {', '.join(stale)} belong to its traits record: "
                            f"traits = Traits({stale[0]}=...) (grace_legacy.core.traits)")
        traits = cls.__dict__.get("traits")
        if traits is None or isinstance(traits, property | functools.cached_property):  # inherited, or derived
            return
        if not isinstance(traits, Traits):
            raise TypeError(f"{cls.__name__}.traits must be a Traits record, got {type(traits).__name__}")
        for name, method in NEEDS.items():
            declared = traits.rounds > 1 if name == "rounds" else getattr(traits, name)
            if declared and not hasattr(cls, method):
                raise TypeError(f"{cls.__name__}: its traits say {name} but it does not define {method}")

    # -- encoding ---------------------------------------------------------------------------
    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        """Encode ``tensor``; return (payload, ctx). Only the payload leaves the rank."""

    @abstractmethod
    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """Decode one payload into a tensor of the original shape and dtype."""

    def aggregate(self, payloads: Sequence[Payload], ctx: Any, average: bool) -> torch.Tensor:
        """``sum_r D(p_r)``, divided by the number of ranks when ``average``; override for a faster
        exact sum or another rule (a vote)."""
        total = self.decompress(payloads[0], ctx).clone()
        for payload in payloads[1:]:
            total += self.decompress(payload, ctx)
        if average:
            total /= len(payloads)
        return total

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """(element count, dtype) of each payload part for a tensor of ``numel`` elements, as
        configured now: the byte-cost model predicts bytes from it without compressing."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its payload size")

    def payload_spec_for(self, shape: torch.Size, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        """:meth:`payload_spec` for a tensor of this shape; override where the shape matters."""
        return self.payload_spec(shape.numel(), dtype)

    def scatter_context(self, ctx: Any) -> Any | None:
        """The ``SparseContext`` of the result where :meth:`aggregate` is exactly a rank-by-rank
        scatter-add of part 0 (values) at part 1 (flat indices) into zeros, so a bucket may sum all
        such members at once; ``None`` otherwise."""
        return None

    def compressor_for(self, tensor: torch.Tensor, name: str) -> Compressor | None:
        """The compressor that encodes ``tensor`` now, or ``None`` to send it uncompressed; decided
        only from what every rank shares (shape, name, progress), so all ranks take one route."""
        return self

    def for_sums(self) -> Compressor:
        """The compressor that re-encodes an aggregate at its shard's owner (a scatter-gather's
        second phase): this one, unless compressing keeps per-tensor state of this rank's own
        gradients (Signum's momentum) or the aggregate takes values the payload cannot say (a
        majority vote's ties). Its payload has this one's parts, in number and dtype."""
        return self

    # -- pairing with a memory --------------------------------------------------------------
    def recommended_memory(self) -> Memory:
        """The memory GRACE pairs with this compressor when the user names none."""
        return NoMemory()

    def check_memory(self, memory: Memory) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` if this compressor cannot work with ``memory``."""

    def set_rank(self, rank: int) -> None:
        """This process's rank among those it exchanges gradients with (set by the bundle; a
        randomized compressor keys its per-rank draws by it)."""
        self.rank = rank

    # -- checkpoints ----------------------------------------------------------------------
    def rejoin_state(self, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        """The state to continue from after the world changed: ``shared`` (rank 0's), except what
        is per rank (Signum's momentum), which subclasses keep from ``own`` (docs/DESIGN.md#elastic-state)."""
        return dict(shared)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Tunable(Compressor):
    """Opt-in: one parameter a schedule may set (Top-k's density, QSGD's levels), declared as
    :attr:`parameter` and set by ``self._set_value(value)`` in ``__init__`` (``None``: left for a
    schedule). ``Legacy`` and the other schedules take a tunable compressor built without it and
    configure copies with :meth:`with_value`."""

    #: the parameter's name, range and dense value
    parameter: ClassVar[ScheduledParameter]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._value: Any = None

    @property
    def value(self) -> Any:
        """The current value of :attr:`parameter` (``None``: not set, or dense)."""
        return self._value

    def _set_value(self, value: Any) -> None:
        self._value = self.parameter.check(value, type(self).__name__)

    def with_value(self, value: Any) -> Compressor:
        """A copy with its parameter set to ``value``, sharing this one's per-tensor state (step
        counters, generators), so that a schedule changing the value does not reset it."""
        clone = copy.copy(self)
        clone._set_value(value)
        return clone

    def check_ready(self) -> None:
        """Raise if this compressor cannot be used on its own (its parameter was never set)."""
        if self._value is None:
            raise ValueError(
                f"{type(self).__name__}() was built without its {self.parameter.name}: pass one, e.g. "
                f"{type(self).__name__}({self.parameter.name}=...), or wrap it in Legacy(...) which sets it")

    def compressor_for(self, tensor: torch.Tensor, name: str) -> Compressor | None:
        """``None`` (send dense) where the value means dense, as density 1.0 does."""
        self.check_ready()
        return None if self.parameter.is_dense(self._value) else self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.parameter.name}={self._value!r})"


class Sparsifier(Compressor):
    """Opt-in: a payload that carries some of the input's entries and says which (:meth:`support`),
    so error feedback can zero exactly those (``Residual``) and DGC's memory can mask them. Declare
    ``traits = Traits(sends_entries=True)`` where the values are the input's own, unscaled."""

    @abstractmethod
    def support(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """The flat indices whose values ``payload`` carries."""


class Elementwise(Compressor):
    """Opt-in: a one-part additive payload decoded entry by entry (FP16, BF16, none), so a fused
    allreduce's whole bucket is decoded by one call. Declare ``traits = Traits(additive=True,
    elementwise=True)``."""

    @abstractmethod
    def decompress_flat(self, flat: torch.Tensor, contexts: Sequence[Any],
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """The payloads of several tensors, lying back to back in the 1-D ``flat`` (as a fused
        allreduce delivers them), decoded at once into one 1-D tensor whose consecutive pieces are
        the tensors' :meth:`decompress` bit for bit. ``out``: a 1-D tensor of ``flat``'s length to
        decode into when it has the results' dtype (it is then returned), else ignored."""


class MultiRound(Compressor):
    """Opt-in: an additive payload sent in several allreduces, each made from the previous round's
    sum (PowerSGD: P, then Q). Declare ``traits = Traits(additive=True, rounds=N)``."""

    @abstractmethod
    def next_round(self, reduced: Payload, ctx: Any) -> tuple[Payload, Any]:
        """The next local payload, given the previous round's sum."""

    def end_exchange(self, reduced: Payload, ctx: Any) -> None:  # noqa: B027 (optional hook)
        """The last round's reduced payload, before it is decoded (PowerSGD keeps Q)."""

    def decompress_into(self, payload: Payload, ctx: Any, out: torch.Tensor) -> torch.Tensor | None:
        """:meth:`decompress` written into ``out``, the gradient's own storage its caller hands over
        (the DDP hook's bucket), and returned; ``None`` where it cannot, and :meth:`decompress` runs.
        A multi-round payload is decoded after every round has arrived, when nothing reads the
        gradient any more, so its result can take the gradient's place instead of being copied there."""
        return None

    def surely_finite(self, payload: Payload, ctx: Any) -> bool:
        """Whether decoding the last round's sum ``payload`` surely gives only finite values, known
        from a bound on the payload itself, so that nobody need look at the (much larger) result for
        an inf or NaN; ``False`` (the default): look."""
        return False


class Randomized(Compressor):
    """Opt-in: a compressor that draws random numbers, only from :meth:`generator` or
    :meth:`step_seed`, keyed by ``(seed, rank, name, step)`` with ``step = self.next_step(name)``:
    a run is reproducible, a rank's draws can be replayed, and a checkpoint (the step counters)
    resumes them exactly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # before the compressor it is mixed into (DGC: TopK's)
        # Shared (not copied) by with_value copies, so a schedule changing the value keeps counting.
        self._steps: dict[str, int] = {}

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

    def state_dict(self) -> dict[str, Any]:
        """Adds the per-tensor step counters: with the seed and rank, the state of every generator."""
        return {**super().state_dict(), "steps": dict(self._steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # In place: with_value copies share this dict.
        self._steps.clear()
        self._steps.update(state["steps"])
