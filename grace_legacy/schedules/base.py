"""What every schedule of a compressor's parameter shares (the contract: docs/IMPLEMENTING.md)."""

from __future__ import annotations

import dataclasses
import functools
from abc import abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import torch

from grace_legacy.core.backend import Backend
from grace_legacy.core.compressor import Compressor, Payload, Tunable
from grace_legacy.core.traits import Traits
from grace_legacy.runtime.validation import ArgumentTypeError, check_gradient, check_positive_int, is_int


class Schedule(Compressor):
    """Wraps a compressor built without its parameter (``TopK()``) and sets the parameter per tensor
    and step: :meth:`value_for`, which subclasses implement, names the value. One configured copy of
    the base per value, sharing the base's per-tensor state (step counters, generators, warm starts),
    so a change of value resets nothing (docs/DESIGN.md#legacy-lookup). A dense value (``None``,
    density ``1.0``) sends the tensor uncompressed; otherwise the configured base decides (PowerSGD
    still sends a 1-D tensor dense), and everything about payloads is the base's.

    Progress: the epoch given to :meth:`set_epoch`, or with ``steps_per_epoch=N`` the optimizer
    steps counted by :meth:`end_step` (after every synchronization) divided by ``N``."""

    def __init__(self, base: Compressor, *, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(base, Compressor) or isinstance(base, Schedule):
            raise ArgumentTypeError(f"{owner}: base must be a grace_legacy compressor (not a Legacy or another "
                            f"schedule), got {base!r}")
        if not isinstance(base, Tunable):
            raise ValueError(f"{owner}: {type(base).__name__} has no parameter to schedule")
        if base.value is not None:
            raise ValueError(f"{owner}: the base's {base.parameter.name}={base.value!r} would be ignored; build it "
                             f"without one ({type(base).__name__}()) and give the values to {owner}")
        self.base = base
        self.steps_per_epoch = None if steps_per_epoch is None else check_positive_int(
            steps_per_epoch, "steps_per_epoch", owner)
        self._configured: dict[Any, Compressor] = {}
        self.epoch = 0
        self.steps = 0

    def _configure(self, values: Iterable[Any]) -> None:
        """Build the configured copy of every non-dense value in ``values`` (once each)."""
        for value in values:
            if not self.base.parameter.is_dense(value) and value not in self._configured:
                self._configured[value] = self.base.with_value(value)

    def configured(self, value: Any) -> Compressor | None:
        """The configured base for ``value``; ``None`` where the value means dense."""
        if self.base.parameter.is_dense(value):
            return None
        configured = self._configured.get(value)
        if configured is None:
            self._configure([value])
            configured = self._configured[value]
        return configured

    @abstractmethod
    def value_for(self, tensor: torch.Tensor, name: str) -> Any:
        """The parameter value for ``tensor`` (named ``name``) now. Must be the same on every rank."""

    def observe(self, name: str, aggregated: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """The aggregated gradient of ``name`` this step, the same on every rank (adaptive schedules
        decide from it)."""

    @property
    def stats(self) -> dict[str, Any]:
        """What this schedule decided, under its own key (Accordion's regimes, L-GreCo's solves,
        DGC's warm-up); nothing by default. The bundle's :attr:`~grace_legacy.Grace.stats` holds it
        beside the traffic."""
        return {}

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Hashable]:
        """Labels under which :attr:`stats` breaks this tensor's bytes down (none by default)."""
        return {}

    # -- what the base decides about payloads ---------------------------------------------------
    @property
    def parameter(self):  # type: ignore[override]
        return self.base.parameter

    @functools.cached_property
    def traits(self) -> Traits:  # type: ignore[override]
        # A schedule decides per tensor and step, so what holds of one compressor's every tensor
        # (exact, decoded entry by entry, always delivering inf and NaN) is not claimed for it.
        # Made once: the routes read it for every tensor, and the base never changes.
        return dataclasses.replace(self.base.traits, lossless=False, elementwise=False, delivers_nonfinite=False)

    def set_rank(self, rank: int) -> None:
        super().set_rank(rank)
        self.base.set_rank(rank)
        for configured in self._configured.values():
            configured.set_rank(rank)

    def recommended_memory(self):
        return self.base.recommended_memory()

    def check_memory(self, memory) -> None:
        self.base.check_memory(memory)

    # Configured copies share the base's per-tensor state, so the base speaks for them all.
    def undo(self, name: str) -> None:
        super().undo(name)
        self.base.undo(name)

    # -- progress -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Enter epoch ``epoch`` (0-based), like ``DistributedSampler.set_epoch``."""
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"{type(self).__name__}.set_epoch: epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = int(epoch)
        if self.steps_per_epoch is not None:
            self.steps = self.epoch * self.steps_per_epoch

    def end_step(self, backend: Backend | None = None) -> None:
        """Count one optimizer step (called by the distributed optimizer after synchronizing)."""
        super().end_step(backend)
        self.base.end_step()
        self.steps += 1
        if self.steps_per_epoch is not None:
            self.epoch = self.steps // self.steps_per_epoch

    @property
    def progress(self) -> Fraction:
        """Training progress in epochs: fractional when steps are counted."""
        if self.steps_per_epoch is not None:
            return Fraction(self.steps, self.steps_per_epoch)
        return Fraction(self.epoch)

    # -- encoding -------------------------------------------------------------------------------
    def compressor_for(self, tensor: torch.Tensor, name: str) -> Compressor | None:
        chosen = self.configured(self.value_for(tensor, name))
        return None if chosen is None else chosen.compressor_for(tensor, name)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        # Here too, not only in the base: a dense value would pass any tensor through unchecked.
        check_gradient(tensor, type(self).__name__)
        concrete = self.compressor_for(tensor, name)
        if concrete is None:
            return [tensor], (None, None)
        payload, ctx = concrete.compress(tensor, name)
        return payload, (concrete, ctx)

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        concrete, inner = ctx
        return payload[0] if concrete is None else concrete.decompress(payload, inner)

    def aggregate(self, payloads: Sequence[Payload], ctx: Any, average: bool) -> torch.Tensor:
        concrete, inner = ctx
        if concrete is None:
            return super().aggregate(payloads, ctx, average)
        return concrete.aggregate(payloads, inner, average)

    def scatter_context(self, ctx: Any) -> Any | None:
        concrete, inner = ctx
        return None if concrete is None else concrete.scatter_context(inner)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.epoch, "optimizer_steps": self.steps,
                "base": self.base.state_dict()}

    def rejoin_state(self, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        # Progress and decisions are rank 0's (every rank must pick the same parameter); the base
        # decides what of its own state is per rank.
        return {**super().rejoin_state(shared, own), "base": self.base.rejoin_state(shared["base"], own["base"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.epoch, self.steps = state["epoch"], state["optimizer_steps"]
        self.base.load_state_dict(state["base"])
