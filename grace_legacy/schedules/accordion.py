"""Accordion: light compression in critical regimes, heavy otherwise, decided per tensor."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from typing import Any

import torch

from grace_legacy.core.backend import Backend
from grace_legacy.core.compressor import Compressor
from grace_legacy.core.state import UndoLog
from grace_legacy.runtime.cost import REFERENCE_SHAPE, bytes_sent
from grace_legacy.runtime.validation import check_positive_int, checked_value, positive_number
from grace_legacy.schedules.accumulator import GradientAccumulator
from grace_legacy.schedules.base import Schedule
from grace_legacy.schedules.history import (
    DEFAULT_HISTORY,
    bounded_records,
    check_history,
    decisions_digest,
    note_change,
)


class Accordion(Schedule):
    """Accordion (Agarwal et al., "Adaptive Gradient Communication via Critical Learning Regime
    Identification", MLSys 2021): per tensor, ``low`` (light compression, more bytes: the paper's
    ell_low) in critical regimes, ``high`` otherwise. Any parameter, either value may be ``None``
    (dense); where the base predicts its bytes ``low`` must send at least as many as ``high``.

    Steps are cut into intervals of ``interval`` optimizer steps (the paper: one or a few epochs,
    e.g. ``len(loader)``). For every tensor ``l``, with L2 norms:

        Delta_l(k) = sum of the aggregated gradient of l over the steps of interval k
        r_l(k)     = | ||Delta_l(k-1)|| - ||Delta_l(k)|| | / ||Delta_l(k-1)||
        critical in interval k + 1  <=>  k == 0, or ||Delta_l(k-1)|| == 0, or r_l(k) >= eta

    so intervals 0 and 1 are critical. A tensor without a finite observation in an interval keeps
    its regime and its last norm. A learning-rate drop (:meth:`notify_lr_drop`, told to every rank at
    the same step) makes every tensor critical until the interval in progress ends. Decided from the
    aggregated gradient, the same on every rank (docs/DESIGN.md#adaptive-schedules); keeps one
    accumulated gradient per tensor and the last ``history`` records (``None``: all)."""

    def __init__(self, base: Compressor, low: Any, high: Any, *, eta: float = 0.5, interval: int,
                 history: int | None = DEFAULT_HISTORY) -> None:
        super().__init__(base)
        parameter = base.parameter
        low = checked_value(parameter, low, "Accordion(low)")
        high = checked_value(parameter, high, "Accordion(high)")
        if low == high or (parameter.is_dense(low) and parameter.is_dense(high)):
            raise ValueError(f"Accordion: low and high must differ (low={low!r}, high={high!r}); for one value "
                             f"use {type(base).__name__}({parameter.name}=...)")
        light, heavy = self._predicted_bytes(low), self._predicted_bytes(high)
        if light is not None and heavy is not None and light < heavy:
            raise ValueError(f"Accordion: low={low!r} is the light compression of critical regimes and must send "
                             f"at least as many bytes as high={high!r} ({light} < {heavy} bytes for a "
                             f"{REFERENCE_SHAPE[0]}x{REFERENCE_SHAPE[1]} float32 tensor); swap them")
        self.low, self.high = low, high
        self.eta = positive_number(eta, "eta", "Accordion")
        self.interval = check_positive_int(interval, "interval", "Accordion")
        self.history = check_history(history, "Accordion")
        self._configure([low, high])
        self.undo_log = UndoLog()
        self._accumulated = GradientAccumulator(self.undo_log)
        self._previous_norm: dict[str, float] = {}
        self._critical: dict[str, bool] = {}
        self._ratios: dict[str, float | None] = {}
        self._override_until: int | None = None
        self._lr: float | None = None
        self._lr_drops: deque[int] = bounded_records((), self.history)
        self._history: dict[str, deque[tuple[int, Any]]] = {}

    def _predicted_bytes(self, value: Any) -> int | None:
        try:
            return bytes_sent(self.configured(value), REFERENCE_SHAPE, torch.float32)
        except NotImplementedError:
            return None

    # -- decisions ------------------------------------------------------------------------------
    @property
    def lr_drop_active(self) -> bool:
        """Whether a learning-rate drop holds every tensor critical now."""
        return self._override_until is not None and self.steps < self._override_until

    def regime_of(self, name: str) -> str:
        """``"critical"`` (detected), ``"lr-drop"`` (critical because the learning rate dropped)
        or ``"normal"``, for the step in progress."""
        if self._critical.get(name, True):
            return "critical"
        return "lr-drop" if self.lr_drop_active else "normal"

    def value_of(self, name: str) -> Any:
        """The parameter value of tensor ``name`` for the step in progress."""
        return self.high if self.regime_of(name) == "normal" else self.low

    def value_for(self, tensor: torch.Tensor, name: str) -> Any:
        return self.value_of(name)

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Hashable]:
        return {"regime": self.regime_of(name)}

    def observe(self, name: str, aggregated: torch.Tensor) -> None:
        if self._accumulated.add(name, aggregated) and name not in self._history:
            self._history[name] = bounded_records([(self.steps, self.value_of(name))], self.history)

    def end_step(self, backend: Backend | None = None) -> None:
        super().end_step(backend)
        if self.steps % self.interval == 0:
            self._detect()
        self._record_history()

    def _detect(self) -> None:
        for name in sorted(self._accumulated.sums):
            norm = float(torch.linalg.vector_norm(self._accumulated.sums[name], dtype=torch.float64))
            previous = self._previous_norm.get(name)
            if previous is None:
                ratio, critical = None, True
            elif previous == 0:
                ratio, critical = math.inf, True
            else:
                ratio = abs(previous - norm) / previous
                critical = ratio >= self.eta
            self._previous_norm[name], self._critical[name], self._ratios[name] = norm, critical, ratio
        self._accumulated.clear()

    def _record_history(self) -> None:
        for name, changes in self._history.items():
            note_change(changes, self.steps, self.value_of(name))

    def notify_lr_drop(self) -> None:
        """The learning rate was just lowered: every tensor is critical until the end of the
        interval in progress (the whole next one if called between intervals)."""
        self._override_until = (self.steps // self.interval + 1) * self.interval
        self._lr_drops.append(self.steps)
        self._record_history()

    def set_lr(self, lr: float) -> None:
        """Tell Accordion the learning rate now (e.g. every epoch); a smaller one than last time
        is a drop (:meth:`notify_lr_drop`)."""
        lr = positive_number(lr, "lr", "Accordion.set_lr")
        if self._lr is not None and lr < self._lr:
            self.notify_lr_drop()
        self._lr = lr

    # -- bookkeeping ----------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        return {**super().stats, "accordion": {
            "intervals": self.steps // self.interval,
            "critical": sorted(n for n in self._history if self.regime_of(n) != "normal"),
            "ratios": dict(sorted(self._ratios.items())),
            "lr_drops": list(self._lr_drops),
            "history": {n: [list(c) for c in changes] for n, changes in sorted(self._history.items())},
        }}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "accumulated": self._accumulated.state_dict(),
                "previous_norm": dict(self._previous_norm), "critical": dict(self._critical),
                "ratios": dict(self._ratios), "override_until": self._override_until, "lr": self._lr,
                "lr_drops": list(self._lr_drops),
                "history": {n: list(changes) for n, changes in self._history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._accumulated.load_state_dict(state["accumulated"])
        self._previous_norm = dict(state["previous_norm"])
        self._critical = dict(state["critical"])
        self._ratios = dict(state["ratios"])
        self._override_until, self._lr = state["override_until"], state["lr"]
        self._lr_drops = bounded_records(state["lr_drops"], self.history)
        self._history = {n: bounded_records((tuple(c) for c in changes), self.history)
                         for n, changes in state["history"].items()}

    def configuration(self) -> str:
        return (f"Accordion({self.base!r}, low={self.low!r}, high={self.high!r}, eta={self.eta!r}, "
                f"interval={self.interval})")

    def __repr__(self) -> str:
        # The decisions' digest lets the consistency check catch a rank resumed from another state.
        decided = decisions_digest((sorted(self._critical.items()), self._override_until))
        return f"{self.configuration()[:-1]}, decisions={decided})"
