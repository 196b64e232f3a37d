"""Adaptive schedules of a compressor's knob: DGC's warm-up, Accordion and L-GreCo.

Each one wraps a compressor built without its knob (``TopK()``, ``QSGD()``, ``PowerSGD()``) and
sets that knob per tensor and step, exactly as :class:`~grace_legacy.Legacy` does (they share
:class:`~grace_legacy.schedule.KnobSchedule`): a value is turned into a configured copy of the
base once, the payloads, memories and communicators are the base's, and the bundle never knows a
schedule is there. What differs is how the value is chosen:

* :class:`DGCWarmup`: from training progress alone (Lin et al., ICLR 2018).
* :class:`Accordion`: per tensor, from how fast the norm of its accumulated gradient changes
  between intervals, and from learning-rate drops (Agarwal et al., MLSys 2021).
* :class:`LGreCo`: per tensor, by a dynamic program over measured compression errors, re-solved
  every ``interval`` steps (Markov, Alimohammadi, Frantar and Alistarh, MLSys 2024).

Every rank must choose the same value for the same tensor, or their collectives would not match.
Accordion decides from the *aggregated* gradient (``Compressor.observe``), which is the same on
every rank, so it needs no communication. L-GreCo's errors are measured on rank 0 only and its
choices are broadcast (``end_step(backend)``), so ranks agree whatever each one measured.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import torch

from grace_legacy.core import Backend, Compressor, Knob, StepJournal, derived_seed, nonfinite_flag
from grace_legacy.grace import bytes_sent
from grace_legacy.schedule import ArgumentTypeError, KnobSchedule, check_positive_int, is_int

#: The shape at which Accordion compares the bytes of ``low`` and ``high`` (a 1M-element matrix).
_PROBE_SHAPE = torch.Size([1024, 1024])

#: How many records (knob changes per tensor, solves, learning-rate drops) stats keep by default.
DEFAULT_HISTORY = 100


def _check_history(history: Any, owner: str) -> int | None:
    if history is None:
        return None
    return check_positive_int(history, "history", owner)


def _records(items: Iterable[Any], bound: int | None) -> deque:
    """The most recent ``bound`` of ``items`` (all of them for ``None``): a long run's history
    must not grow its memory step after step."""
    return deque(items, maxlen=bound)


def _knob_value(knob: Knob, value: Any, where: str) -> Any:
    try:
        return knob.check(value, where)
    except TypeError as err:
        raise ArgumentTypeError(str(err)) from None


def _positive(value: Any, argument: str, owner: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{owner}: {argument} must be a finite number > 0, got {value!r} "
                                f"of type {type(value).__name__}")
    if not math.isfinite(float(value)) or not value > 0:
        raise ValueError(f"{owner}: {argument} must be a finite number > 0, got {value!r}")
    return float(value)


def _digest(decisions: Any) -> str:
    return f"{derived_seed(repr(decisions)):016x}"


def _show(value: Any) -> Hashable:
    """A knob value as a stats key: ``"dense"`` for ``None``."""
    return "dense" if value is None else value


def _note_change(changes: deque[tuple[int, Any]], step: int, value: Any) -> None:
    """Append ``(step, value)`` to a knob history if the value changed; a second change at the same
    step (a boundary, then a learning-rate drop) replaces the first, which never took effect."""
    if changes and changes[-1][1] == value:
        return
    if changes and changes[-1][0] == step:
        changes.pop()
        if changes and changes[-1][1] == value:
            return
    changes.append((step, value))


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Accumulator:
    """The sum of each tensor's finite aggregated gradients since the last :meth:`clear`, kept out
    of place so that a :class:`StepJournal` can undo one step's addition (a skipped step)."""

    def __init__(self, journal: StepJournal) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self._journal = journal

    def add(self, name: str, aggregated: torch.Tensor) -> bool:
        """Add ``aggregated`` unless it holds an inf or NaN; return whether it was added."""
        if bool(nonfinite_flag(aggregated)):
            return False
        self._journal.remember(self.sums, name)
        self._journal.remember(self.counts, name)
        g = aggregated.detach().to(_work_dtype(aggregated.dtype))
        previous = self.sums.get(name)
        # A copy the first time: the optimizer may later scale or NaN-fill the gradient in place.
        self.sums[name] = g.clone() if previous is None else previous + g
        self.counts[name] = self.counts.get(name, 0) + 1
        return True

    def clear(self) -> None:
        self.sums.clear()
        self.counts.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"sums": {n: t.clone() for n, t in self.sums.items()}, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clear()
        self.sums.update({n: t.clone() for n, t in state["sums"].items()})
        self.counts.update(state["counts"])


# -- DGC warm-up ----------------------------------------------------------------------------------


class DGCWarmup(KnobSchedule):
    """Deep Gradient Compression's warm-up training (Lin, Han, Mao, Wang and Dally, ICLR 2018):
    the knob moves exponentially from ``start`` to ``target`` over the first ``warmup_epochs``
    epochs, then stays at ``target``. For epoch ``e`` (0-based) and ``W = warmup_epochs``:

        value(e) = start * c ** (e + 1)      for e < W, clamped so that it never passes target
        value(e) = target                    for e >= W
        c        = (target / start) ** (1 / (W + 1))     unless coeff= gives c

    With a density knob (Top-k, Random-k, DGC) ``start`` defaults to ``1.0`` (dense), so the
    default is the DGC reference implementation's ``max(target ** ((e + 1) / (W + 1)), target)``.
    The paper's sequence for ``target=0.001``, "25%, 6.25%, 1.5625%, 0.4%, then 0.1%", is
    ``coeff=0.25``: ``0.25, 0.0625, 0.015625, 0.00390625, 0.001``.

    Any knob whose values are positive works: integer knobs (QSGD's ``levels``, PowerSGD's
    ``rank``) are rounded to the nearest integer and need an explicit ``start`` (e.g.
    ``DGCWarmup(QSGD(), target=4, start=256)``: 111, 49, 21, 9, then 4 levels); so does
    Threshold, whose threshold then *grows* towards ``target``.

    Progress as in :class:`~grace_legacy.Legacy`: the epoch given to :meth:`set_epoch`, or, with
    ``steps_per_epoch``, ``floor(steps / steps_per_epoch)`` of the optimizer steps counted by
    :meth:`end_step`. The same on every rank, so no communication is needed.
    """

    def __init__(self, base: Compressor, target: Any, warmup_epochs: int = 4, *, start: Any = None,
                 coeff: float | None = None, steps_per_epoch: int | None = None) -> None:
        super().__init__(base, steps_per_epoch=steps_per_epoch)
        knob = base.knob
        target = _knob_value(knob, target, "DGCWarmup(target)")
        if target is None or knob.is_dense(target):
            raise ValueError(f"DGCWarmup: target must be a value that compresses, got {target!r}")
        if start is None:
            if not isinstance(knob.dense, numbers.Real):
                raise ValueError(f"DGCWarmup: start is needed for {type(base).__name__}'s {knob.name} (it has no "
                                 f"dense value to start from); e.g. DGCWarmup({type(base).__name__}(), target="
                                 f"{target!r}, start=...)")
            start = knob.dense
        start = _knob_value(knob, start, "DGCWarmup(start)")
        if start is None:
            raise ValueError("DGCWarmup: start must be a number")
        for argument, value in (("target", target), ("start", start)):
            if not value > 0:
                raise ValueError(f"DGCWarmup: {argument} must be > 0 (the warm-up is geometric), got {value!r}")
        if not is_int(warmup_epochs) or warmup_epochs < 0:
            raise ValueError(f"DGCWarmup: warmup_epochs must be a non-negative integer, got {warmup_epochs!r}")
        if coeff is not None:
            coeff = _positive(coeff, "coeff", "DGCWarmup")
            if (target < start and not coeff < 1) or (target > start and not coeff > 1):
                raise ValueError(f"DGCWarmup: coeff={coeff!r} moves away from target={target!r} "
                                 f"(start={start!r}); it must be {'< 1' if target < start else '> 1'}")
        self.target, self.start, self.warmup_epochs, self.coeff = target, start, int(warmup_epochs), coeff
        self.values: list[Any] = [self._warmup_value(e) for e in range(self.warmup_epochs)] + [target]
        self._configure(self.values)

    def _warmup_value(self, epoch: int) -> Any:
        low, high = min(self.start, self.target), max(self.start, self.target)
        if self.coeff is None:
            value = self.start * (self.target / self.start) ** ((epoch + 1) / (self.warmup_epochs + 1))
        else:
            value = self.start * self.coeff ** (epoch + 1)
        value = min(high, max(low, value))
        if self.base.knob.integer:
            value = min(high, max(low, math.floor(value + 0.5)))
        return self.base.knob.check(value, "DGCWarmup")

    def phase_of(self, epoch: int) -> int:
        """Index into :attr:`values` at ``epoch``: the epoch itself during the warm-up, then ``W``."""
        return min(int(epoch), self.warmup_epochs)

    def knob_at(self, epoch: int) -> Any:
        """The knob value at epoch ``epoch``."""
        return self.values[self.phase_of(epoch)]

    def knob_for_tensor(self, tensor: torch.Tensor, name: str) -> Any:
        return self.knob_at(math.floor(self.progress))

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Hashable]:
        return {"phase": self.phase_of(math.floor(self.progress))}

    @property
    def stats(self) -> dict[str, Any]:
        epoch = math.floor(self.progress)
        return {**super().stats, "warmup": {"values": list(self.values), "epoch": epoch,
                                            "phase": self.phase_of(epoch), "current": self.knob_at(epoch)}}

    def __repr__(self) -> str:
        parts = [repr(self.base), f"target={self.target!r}", f"warmup_epochs={self.warmup_epochs}",
                 f"start={self.start!r}"]
        if self.coeff is not None:
            parts.append(f"coeff={self.coeff!r}")
        if self.steps_per_epoch is not None:
            parts.append(f"steps_per_epoch={self.steps_per_epoch}")
        return f"DGCWarmup({', '.join(parts)})"


# -- Accordion ------------------------------------------------------------------------------------


class Accordion(KnobSchedule):
    """Accordion (Agarwal, Wang, Jiang, Zhang, Papailiopoulos, "Adaptive Gradient Communication
    via Critical Learning Regime Identification", MLSys 2021): light compression in *critical
    regimes*, heavy compression otherwise, decided per tensor.

    ``low`` and ``high`` are the paper's ell_low and ell_high: the knob values of *low*
    compression (e.g. Top-k density 0.1, PowerSGD rank 4: more bytes) used in critical regimes,
    and of *high* compression (density 0.01, rank 1) used otherwise. Steps are cut into intervals
    of ``interval`` optimizer steps (the paper detects at epoch granularity: ``interval`` = one or
    a few epochs' worth of steps, e.g. ``len(loader)``). For every tensor ``l``:

        Delta_l(k) = sum of the aggregated gradient of l over the steps of interval k
        r_l(k)     = | ||Delta_l(k-1)|| - ||Delta_l(k)|| | / ||Delta_l(k-1)||       (L2 norms)
        critical in interval k + 1  <=>  k == 0, or ||Delta_l(k-1)|| == 0, or r_l(k) >= eta

    so training starts critical (interval 0, and interval 1, for which there is nothing to compare
    yet), and a tensor turns heavy once its accumulated gradient norm changes by less than ``eta``
    (0.5 in the paper) from one interval to the next. A tensor with no finite observation in an
    interval keeps its regime and its last norm.

    Learning-rate drops: :meth:`notify_lr_drop` (or :meth:`set_lr` with a smaller rate than the
    last one) makes every tensor critical from the next step until the end of the interval in
    progress, i.e. for the whole next interval when called between intervals, as the reference
    implementation does after a decay epoch; the boundary then decides as usual. Every rank must
    be told at the same step (they all run the same learning-rate schedule).

    Ranks agree without communication: the norms are of the *aggregated* gradient
    (``observe(name, aggregated)``), which is the same on every rank; the reference
    implementation instead measured rank 0's local gradient and broadcast its choice.
    Observations holding an inf or NaN are ignored, and a skipped step's are rolled back. Memory:
    one accumulated gradient per tensor (float32, float64 for float64 gradients), and the last
    ``history`` knob changes per tensor and learning-rate drops for :attr:`stats` (``None`` keeps
    every one, growing with the run).

    Works with any knob: two values of it (either may be ``None``, dense). Where the base can
    predict its bytes (Top-k, Random-k, DGC, QSGD, PowerSGD), ``low`` must send at least as many
    as ``high``; for Threshold, ``low`` is the smaller threshold.
    """

    def __init__(self, base: Compressor, low: Any, high: Any, *, eta: float = 0.5, interval: int,
                 history: int | None = DEFAULT_HISTORY) -> None:
        super().__init__(base)
        knob = base.knob
        low = _knob_value(knob, low, "Accordion(low)")
        high = _knob_value(knob, high, "Accordion(high)")
        if low == high or (knob.is_dense(low) and knob.is_dense(high)):
            raise ValueError(f"Accordion: low and high must differ (low={low!r}, high={high!r}); for one value "
                             f"use {type(base).__name__}({knob.name}=...)")
        light, heavy = self._predicted_bytes(low), self._predicted_bytes(high)
        if light is not None and heavy is not None and light < heavy:
            raise ValueError(f"Accordion: low={low!r} is the light compression of critical regimes and must send "
                             f"at least as many bytes as high={high!r} ({light} < {heavy} bytes for a "
                             f"{_PROBE_SHAPE[0]}x{_PROBE_SHAPE[1]} float32 tensor); swap them")
        self.low, self.high = low, high
        self.eta = _positive(eta, "eta", "Accordion")
        self.interval = check_positive_int(interval, "interval", "Accordion")
        self.history = _check_history(history, "Accordion")
        self._configure([low, high])
        self._journal = StepJournal()
        self._accumulated = _Accumulator(self._journal)
        self._previous_norm: dict[str, float] = {}
        self._critical: dict[str, bool] = {}
        self._ratios: dict[str, float | None] = {}
        self._override_until: int | None = None
        self._lr: float | None = None
        self._lr_drops: deque[int] = _records((), self.history)
        self._history: dict[str, deque[tuple[int, Any]]] = {}

    def _predicted_bytes(self, value: Any) -> int | None:
        try:
            return bytes_sent(self.concrete(value), _PROBE_SHAPE, torch.float32)
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
        """The knob value of tensor ``name`` for the step in progress."""
        return self.high if self.regime_of(name) == "normal" else self.low

    def knob_for_tensor(self, tensor: torch.Tensor, name: str) -> Any:
        return self.value_of(name)

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Hashable]:
        return {"regime": self.regime_of(name)}

    def observe(self, name: str, aggregated: torch.Tensor) -> None:
        if self._accumulated.add(name, aggregated) and name not in self._history:
            self._history[name] = _records([(self.steps, self.value_of(name))], self.history)

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
            _note_change(changes, self.steps, self.value_of(name))

    def notify_lr_drop(self) -> None:
        """The learning rate was just lowered: every tensor is critical until the end of the
        interval in progress (the whole next one if called between intervals)."""
        self._override_until = (self.steps // self.interval + 1) * self.interval
        self._lr_drops.append(self.steps)
        self._record_history()

    def set_lr(self, lr: float) -> None:
        """Tell Accordion the learning rate now (e.g. every epoch); a smaller one than last time
        is a drop (:meth:`notify_lr_drop`)."""
        lr = _positive(lr, "lr", "Accordion.set_lr")
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
        self._lr_drops = _records(state["lr_drops"], self.history)
        self._history = {n: _records((tuple(c) for c in changes), self.history)
                         for n, changes in state["history"].items()}

    def configuration(self) -> str:
        return (f"Accordion({self.base!r}, low={self.low!r}, high={self.high!r}, eta={self.eta!r}, "
                f"interval={self.interval})")

    def __repr__(self) -> str:
        # The decisions' digest lets the consistency check catch a rank resumed from another state.
        decided = _digest((sorted(self._critical.items()), self._override_until))
        return f"{self.configuration()[:-1]}, decisions={decided})"


# -- L-GreCo --------------------------------------------------------------------------------------


def choose_layerwise(errors: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]], budget: float,
                     resolution: int = 1000) -> list[int] | None:
    """L-GreCo's dynamic program: one choice ``c_l`` per layer minimising ``sum_l sizes[l][c_l]``
    subject to ``sum_l errors[l][c_l] <= budget``; ``None`` if no assignment is found feasible.

    The errors are discretized in units of ``delta = budget / resolution``, rounded *up*:
    ``q_l(c) = ceil(errors[l][c] / delta)`` (in exact rational arithmetic), and the program keeps,
    for every ``b = 0 .. resolution``,

        best_l(b) = min over c of  sizes[l][c] + best_{l-1}(b - q_l(c)),    best_0(b) = 0

    the smallest total size of layers ``1..l`` with ``sum q <= b``; the answer is
    ``best_L(resolution)``, traced back through the recorded choices. Among assignments of equal
    size it keeps the one with the smallest ``sum q`` (then the earlier choice), so that values
    costing the same bytes (QSGD's levels within one integer width) resolve to the most accurate.
    Time ``O(L * C * resolution)`` (vectorized over ``b``), memory ``O(L * resolution)``.

    What the discretization costs, with ``L`` layers:

    * the constraint holds exactly: ``sum e <= delta * sum q <= delta * resolution = budget``;
    * the total size is at most the true optimum under the tighter budget ``budget * (1 - L /
      resolution)``: that optimum's ``sum q <= sum (e / delta + 1) <= resolution``, so the
      program considers it. Assignments whose error lies within ``L * delta`` of the budget may
      be missed, never exceeded.

    ``budget == 0`` admits only zero-error choices (solved layer by layer, no discretization).
    Errors must be finite and >= 0, sizes >= 0.
    """
    layers = len(errors)
    if len(sizes) != layers:
        raise ValueError(f"choose_layerwise: {layers} layers of errors but {len(sizes)} of sizes")
    if not is_int(resolution) or resolution < 1:
        raise ValueError(f"choose_layerwise: resolution must be a positive integer, got {resolution!r}")
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"choose_layerwise: budget must be a finite number >= 0, got {budget!r}")
    for layer, (e_row, s_row) in enumerate(zip(errors, sizes, strict=True)):
        if not e_row or len(e_row) != len(s_row):
            raise ValueError(f"choose_layerwise: layer {layer} has {len(e_row)} errors and {len(s_row)} sizes")
        if any(not math.isfinite(e) or e < 0 for e in e_row) or any(s < 0 for s in s_row):
            raise ValueError(f"choose_layerwise: layer {layer}: errors must be finite and >= 0, sizes >= 0")
    if layers == 0:
        return []
    if budget == 0:
        chosen = []
        for e_row, s_row in zip(errors, sizes, strict=True):
            exact = [c for c, e in enumerate(e_row) if e == 0]
            if not exact:
                return None
            chosen.append(min(exact, key=lambda c: (s_row[c], c)))
        return chosen

    scale = Fraction(resolution) / Fraction(budget)
    inf = math.inf
    width = resolution + 1
    best = torch.zeros(width, dtype=torch.float64)  # smallest total size with sum q <= b
    spent = torch.zeros(width, dtype=torch.float64)  # its sum q (the smallest among equal sizes)
    picks = []
    for e_row, s_row in zip(errors, sizes, strict=True):
        units = [math.ceil(Fraction(e) * scale) for e in e_row]
        new, new_spent = torch.full((width,), inf, dtype=torch.float64), torch.full((width,), inf, dtype=torch.float64)
        pick = torch.full((width,), -1, dtype=torch.int32)
        for c, (q, s) in enumerate(zip(units, s_row, strict=True)):
            if q > resolution:
                continue
            candidate, candidate_spent = torch.full_like(new, inf), torch.full_like(new, inf)
            candidate[q:] = best[: width - q] + float(s)
            candidate_spent[q:] = spent[: width - q] + float(q)
            better = (candidate < new) | ((candidate == new) & (candidate_spent < new_spent))
            new = torch.where(better, candidate, new)
            new_spent = torch.where(better, candidate_spent, new_spent)
            pick = torch.where(better, torch.tensor(c, dtype=torch.int32), pick)
        best, spent = new, new_spent
        picks.append((pick, units))
    if not math.isfinite(float(best[resolution])):
        return None
    chosen: list[int] = []
    b = resolution
    for pick, q in reversed(picks):
        c = int(pick[b])
        chosen.append(c)
        b -= q[c]
    chosen.reverse()
    return chosen


class LGreCo(KnobSchedule):
    """L-GreCo (Markov, Alimohammadi, Frantar and Alistarh, "L-GreCo: Layerwise-Adaptive Gradient
    Compression for Efficient and Accurate Deep Learning", MLSys 2024): a knob per tensor, chosen
    to send as few bytes as possible for no more compression error than a uniform setting.

    Every ``interval`` optimizer steps, for each tensor ``l`` and each value ``c`` in ``choices``:

        G_l      = sum of the aggregated gradient of l over the interval's steps (finite ones)
        e_l(c)   = || G_l - D(C_c(G_l)) ||^2          the base at knob c, applied to G_l
        s_l(c)   = bytes a rank sends for l at knob c (``grace.bytes_sent``: exact, not estimated)

        minimise  sum_l s_l(c_l)   subject to   sum_l e_l(c_l) <= budget * sum_l e_l(reference)

    solved by :func:`choose_layerwise` with ``resolution`` error buckets (the constraint always
    holds; the size is within what the optimum achieves with the budget tightened by ``L /
    resolution`` of itself, ``L`` the number of tensors). If the uniform ``reference`` meets the
    budget and sends fewer bytes than the program's answer (discretization can cost that much),
    or if nothing was found feasible, every tensor takes ``reference``. Until the first solve,
    and for a tensor without a finite observation in the interval, the choice stays as it was
    (``reference`` at first).

    Agreement: only rank 0 measures errors and solves (compressing ``G_l`` once per choice, on a
    deep copy of the base so that no step counter, generator or warm start of the real one
    moves); its choices are broadcast to every rank through the backend given to
    :meth:`end_step`, so ranks agree even if their accumulated gradients were to differ. The
    broadcast is one allreduce (sum) of a float64 tensor, one choice index per tensor in name
    order then four summary numbers, to which every other rank contributes zeros: exact, and
    rooted at rank 0 *of the backend* whatever the process set. Without a backend (one
    process) the rank solves alone.

    Any knob whose payload size the base can predict: Top-k, Random-k and DGC (density), QSGD
    (levels: those of one integer width cost the same bytes, and the program then takes the most
    accurate, so mix widths, e.g. ``[4, 127, 1000]``), PowerSGD (rank; its error is that of one
    power iteration from the current warm start, or from a fresh random ``Q`` for a rank not in
    use, so idle ranks look worse than they would be once warm). Not Threshold, whose size
    depends on the data. ``None``/dense may be a choice (error 0, dense bytes).

    Overhead: :attr:`stats` ``["lgreco"]["overhead"]`` times the error measurement, the program and
    the broadcast, against the mean step time (between successive :meth:`end_step` calls).
    Memory: one accumulated gradient per tensor (float32, float64 for float64 gradients), on
    rank 0 during a solve a deep copy of the base's state, and the last ``history`` solves and
    choice changes per tensor for :attr:`stats` (``None`` keeps every one, growing with the run).
    """

    def __init__(self, base: Compressor, choices: Sequence[Any], *, reference: Any, interval: int,
                 budget: float = 1.0, resolution: int = 1000, history: int | None = DEFAULT_HISTORY) -> None:
        super().__init__(base)
        knob = base.knob
        if not isinstance(choices, Sequence) or isinstance(choices, str) or len(choices) < 2:
            raise ValueError(f"LGreCo: choices must be a list of at least two {knob.name} values, got {choices!r}")
        checked = [_knob_value(knob, c, f"LGreCo(choices[{i}])") for i, c in enumerate(choices)]
        keys = ["dense" if knob.is_dense(c) else c for c in checked]
        if len(set(keys)) != len(keys):
            raise ValueError(f"LGreCo: choices must be distinct (None and the dense value are the same), "
                             f"got {checked!r}")
        reference = _knob_value(knob, reference, "LGreCo(reference)")
        matches = [i for i, c in enumerate(checked)
                   if c == reference or (knob.is_dense(c) and knob.is_dense(reference))]
        if not matches:
            raise ValueError(f"LGreCo: reference={reference!r} must be one of choices={checked!r}")
        self.choices = checked
        self.reference = reference
        self.reference_index = matches[0]
        self.interval = check_positive_int(interval, "interval", "LGreCo")
        self.budget = _positive(budget, "budget", "LGreCo")
        self.resolution = check_positive_int(resolution, "resolution", "LGreCo")
        self.history = _check_history(history, "LGreCo")
        self._configure(checked)
        for c in checked:
            try:
                bytes_sent(self.concrete(c), _PROBE_SHAPE, torch.float32)
            except NotImplementedError as err:
                raise ValueError(f"LGreCo: base {type(base).__name__} cannot predict its payload size, which "
                                 f"L-GreCo minimises ({err})") from None
        self._journal = StepJournal()
        self._accumulated = _Accumulator(self._journal)
        self._layouts: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._choice: dict[str, int] = {}
        self._history: dict[str, deque[tuple[int, Any]]] = {}
        self._solves: deque[dict[str, Any]] = _records((), self.history)
        self._timing = {"measure_s": 0.0, "dp_s": 0.0, "broadcast_s": 0.0, "step_s": 0.0, "timed_steps": 0,
                        "solves": 0}
        self._last_end: float | None = None

    # -- decisions ------------------------------------------------------------------------------
    def choice_of(self, name: str) -> Any:
        """The knob value of tensor ``name`` until the next solve."""
        return self.choices[self._choice.get(name, self.reference_index)]

    def knob_for_tensor(self, tensor: torch.Tensor, name: str) -> Any:
        return self.choice_of(name)

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Hashable]:
        return {"choice": _show(self.choice_of(name))}

    def observe(self, name: str, aggregated: torch.Tensor) -> None:
        if self._accumulated.add(name, aggregated) and name not in self._layouts:
            self._layouts[name] = (aggregated.shape, aggregated.dtype)
            self._history[name] = _records([(self.steps, self.choice_of(name))], self.history)

    def measure(self, names: Sequence[str]) -> tuple[list[list[float]], list[list[int]]]:
        """``e_l(c)`` and ``s_l(c)`` of every choice for the accumulated gradient of each of
        ``names``, on a deep copy of the base (the real one's state does not move)."""
        probe = copy.deepcopy(self.base)
        configured = [None if self.base.knob.is_dense(c) else probe.with_knob(c) for c in self.choices]
        errors, sizes = [], []
        for name in names:
            g = self._accumulated.sums[name]
            shape, dtype = self._layouts[name]
            e_row, s_row = [], []
            for concrete in configured:
                chosen = None if concrete is None else concrete.resolve(g, name)
                if chosen is None:
                    e_row.append(0.0)
                    s_row.append(bytes_sent(None, shape, dtype))
                    continue
                payload, ctx = chosen.compress(g, name)
                # One worker: the "sum over ranks" of each round is this payload itself.
                for _ in range(1, chosen.rounds):
                    payload, ctx = chosen.next_round(payload, ctx)
                decoded = chosen.decompress(payload, ctx)
                e_row.append(float(torch.sum((g.double() - decoded.double()) ** 2)))
                s_row.append(bytes_sent(chosen, shape, dtype))
            errors.append(e_row)
            sizes.append(s_row)
        return errors, sizes

    def solve(self, names: Sequence[str]) -> tuple[list[int], dict[str, float]]:
        """This rank's choice index for each of ``names`` from its own accumulated gradients (rank 0
        broadcasts its answer; the others never use theirs), and the solve's summary."""
        indices = [self._choice.get(n, self.reference_index) for n in names]
        active = [i for i, n in enumerate(names) if self._accumulated.counts.get(n, 0) > 0]
        started = time.perf_counter()
        errors, sizes = self.measure([names[i] for i in active])
        measured = time.perf_counter()
        uniform_error = math.fsum(row[self.reference_index] for row in errors)
        uniform_bytes = sum(row[self.reference_index] for row in sizes)
        budget = self.budget * uniform_error
        finite = all(math.isfinite(e) for row in errors for e in row)
        picked = choose_layerwise(errors, sizes, budget, self.resolution) if finite else None
        solved = time.perf_counter()
        if picked is None or (uniform_error <= budget and sum(r[c] for r, c in zip(sizes, picked, strict=True))
                              > uniform_bytes):
            picked = [self.reference_index] * len(active) if finite else [indices[i] for i in active]
        for i, c in zip(active, picked, strict=True):
            indices[i] = c
        info = {"error": math.fsum(r[c] for r, c in zip(errors, picked, strict=True)), "budget": budget,
                "bytes": float(sum(r[c] for r, c in zip(sizes, picked, strict=True))),
                "uniform_bytes": float(uniform_bytes), "measure_s": measured - started, "dp_s": solved - measured}
        return indices, info

    def end_step(self, backend: Backend | None = None) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._timing["step_s"] += now - self._last_end
            self._timing["timed_steps"] += 1
        super().end_step(backend)
        if self.steps % self.interval == 0:
            self._solve_and_share(backend)
        # Excludes the solve, so that step_s is the step time without L-GreCo's work.
        self._last_end = time.perf_counter()

    def _solve_and_share(self, backend: Backend | None) -> None:
        names = sorted(self._layouts)
        if not names:
            return
        shared = backend is not None and backend.size() > 1
        root = not shared or backend.rank() == 0
        if root:
            indices, info = self.solve(names)
            self._timing["measure_s"] += info["measure_s"]
            self._timing["dp_s"] += info["dp_s"]
        else:
            indices, info = [0] * len(names), {"error": 0.0, "budget": 0.0, "bytes": 0.0, "uniform_bytes": 0.0}
        if shared:
            started = time.perf_counter()
            message = torch.tensor([*indices, info["error"], info["budget"], info["bytes"], info["uniform_bytes"]],
                                   dtype=torch.float64)
            if not root:
                message.zero_()
            # A broadcast from the backend's rank 0 as a sum with zeros (exact: x + 0 == x), because
            # HorovodBackend.broadcast_async takes a *global* root rank, which is not rank 0 of a
            # process set that leaves global rank 0 out.
            received = backend.wait(backend.allreduce_async(message, "lgreco.choices", average=False)).tolist()
            self._timing["broadcast_s"] += time.perf_counter() - started
            indices = [int(i) for i in received[: len(names)]]
            info = {**info, **dict(zip(("error", "budget", "bytes", "uniform_bytes"), received[len(names):],
                                       strict=True))}
            if any(not 0 <= i < len(self.choices) for i in indices):
                raise RuntimeError(f"LGreCo: rank 0 sent choice indices {indices} outside 0..{len(self.choices) - 1}")
        for name, index in zip(names, indices, strict=True):
            self._choice[name] = index
            changes = self._history.setdefault(name, _records((), self.history))
            _note_change(changes, self.steps, self.choices[index])
        self._timing["solves"] += 1
        self._solves.append({"step": self.steps, "error": info["error"], "budget": info["budget"],
                             "bytes": info["bytes"], "uniform_bytes": info["uniform_bytes"]})
        self._accumulated.clear()

    # -- bookkeeping ----------------------------------------------------------------------------
    @property
    def overhead(self) -> dict[str, float]:
        """Time spent by L-GreCo (this rank) against the step time without it."""
        t = self._timing
        # Counted apart from the kept records, which keep only the last `history` solves.
        solves = t.get("solves", len(self._solves))
        mean_step = t["step_s"] / t["timed_steps"] if t["timed_steps"] else 0.0
        mean_solve = (t["measure_s"] + t["dp_s"] + t["broadcast_s"]) / solves if solves else 0.0
        return {"solves": solves, "measure_s": t["measure_s"], "dp_s": t["dp_s"], "broadcast_s": t["broadcast_s"],
                "mean_solve_s": mean_solve, "mean_step_s": mean_step,
                # Amortized: one solve per interval steps.
                "fraction_of_step_time": mean_solve / (self.interval * mean_step) if mean_step else 0.0}

    @property
    def stats(self) -> dict[str, Any]:
        return {**super().stats, "lgreco": {
            "choices": {n: self.choice_of(n) for n in sorted(self._layouts)},
            "history": {n: [list(c) for c in changes] for n, changes in sorted(self._history.items())},
            "solves": [dict(s) for s in self._solves],
            "overhead": self.overhead,
        }}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "accumulated": self._accumulated.state_dict(),
                "layouts": {n: (list(shape), str(dtype).removeprefix("torch.")) for n, (shape, dtype)
                            in self._layouts.items()},
                "choice": dict(self._choice), "history": {n: list(c) for n, c in self._history.items()},
                "solves": [dict(s) for s in self._solves], "timing": dict(self._timing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._accumulated.load_state_dict(state["accumulated"])
        self._layouts = {n: (torch.Size(shape), getattr(torch, dtype)) for n, (shape, dtype)
                         in state["layouts"].items()}
        self._choice = dict(state["choice"])
        self._history = {n: _records((tuple(c) for c in changes), self.history)
                         for n, changes in state["history"].items()}
        self._solves = _records((dict(s) for s in state["solves"]), self.history)
        self._timing = {"solves": len(self._solves), **state["timing"]}
        self._last_end = None

    def configuration(self) -> str:
        return (f"LGreCo({self.base!r}, choices={self.choices!r}, reference={self.reference!r}, "
                f"interval={self.interval}, budget={self.budget!r}, resolution={self.resolution})")

    def __repr__(self) -> str:
        # The choices' digest lets the consistency check catch a rank resumed from another state.
        return f"{self.configuration()[:-1]}, decisions={_digest(sorted(self._choice.items()))})"
