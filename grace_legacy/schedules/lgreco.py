"""L-GreCo: a parameter per tensor, chosen by a dynamic program over measured compression errors."""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from collections.abc import Hashable, Sequence
from fractions import Fraction
from typing import Any

import torch

from grace_legacy.core.backend import Backend
from grace_legacy.core.compressor import Compressor
from grace_legacy.core.state import UndoLog
from grace_legacy.runtime.cost import REFERENCE_SHAPE, bytes_sent
from grace_legacy.runtime.validation import check_positive_int, checked_value, is_int, positive_number
from grace_legacy.schedules.accumulator import GradientAccumulator
from grace_legacy.schedules.base import Schedule
from grace_legacy.schedules.history import (
    DEFAULT_HISTORY,
    bounded_records,
    check_history,
    decisions_digest,
    note_change,
    shown_value,
)

#: The most error buckets: the program keeps a choice per bucket and tensor (``resolution + 1``
#: int32 each), so a count far beyond this would exhaust memory at the first solve, not fail here.
MAX_RESOLUTION = 10**6


def choose_layerwise(errors: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]], budget: float,
                     resolution: int = 1000) -> list[int] | None:
    """L-GreCo's dynamic program: one choice ``c_l`` per layer minimising ``sum_l sizes[l][c_l]``
    subject to ``sum_l errors[l][c_l] <= budget``; ``None`` if none is found feasible. Errors must be
    finite and >= 0, sizes >= 0 (``ValueError`` otherwise).

    With ``delta = budget / resolution`` and ``q_l(c) = ceil(errors[l][c] / delta)`` (exact rational
    arithmetic), for every ``b = 0 .. resolution``:

        best_l(b) = min over c of  sizes[l][c] + best_{l-1}(b - q_l(c)),    best_0(b) = 0

    traced back from ``best_L(resolution)``; ties in size go to the smaller ``sum q`` (the most
    accurate of equal-byte values), then the earlier choice. Time ``O(L * C * resolution)``, memory
    ``O(L * resolution)``. The constraint holds exactly (``sum e <= delta * sum q <= budget``), and
    the size is at most the optimum under the budget ``budget * (1 - L / resolution)``, whose
    ``sum q <= resolution``. ``budget == 0`` admits only zero-error choices, layer by layer."""
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


class LGreCo(Schedule):
    """L-GreCo (Markov, Alimohammadi, Frantar and Alistarh, MLSys 2024): a parameter per tensor,
    sending as few bytes as possible for no more compression error than a uniform setting. Every
    ``interval`` optimizer steps, for each tensor ``l`` and value ``c`` in ``choices``:

        G_l      = sum of the finite aggregated gradients of l over the interval
        e_l(c)   = || G_l - D(C_c(G_l)) ||^2
        s_l(c)   = the exact bytes a rank sends for l at c (:func:`~grace_legacy.runtime.cost.bytes_sent`)

        minimise  sum_l s_l(c_l)   subject to   sum_l e_l(c_l) <= budget * sum_l e_l(reference)

    by :func:`choose_layerwise` with ``resolution`` error buckets. Every tensor takes ``reference``
    when nothing is feasible, or when ``reference`` meets the budget with fewer bytes; a tensor keeps
    its choice (at first ``reference``) until it has a finite observation at a solve. Rank 0 solves,
    and every rank of the backend given to :meth:`end_step` takes its choices (alone without one;
    docs/DESIGN.md#adaptive-schedules).

    Any base that predicts its bytes (not Threshold); ``None``/dense may be a choice. QSGD levels of
    one integer width cost the same bytes, so mix widths (``[4, 127, 1000]``). PowerSGD's error is
    one power iteration from the current warm start (a fresh ``Q`` for a rank not in use).
    :attr:`stats` ``["lgreco"]["overhead"]`` times the solves against the step time. Keeps one
    accumulated gradient per tensor and the last ``history`` solves and changes (``None``: all)."""

    def __init__(self, base: Compressor, choices: Sequence[Any], *, reference: Any, interval: int,
                 budget: float = 1.0, resolution: int = 1000, history: int | None = DEFAULT_HISTORY) -> None:
        super().__init__(base)
        parameter = base.parameter
        if not isinstance(choices, Sequence) or isinstance(choices, str) or len(choices) < 2:
            raise ValueError(f"LGreCo: choices must be a list of at least two {parameter.name} values, got {choices!r}")
        checked = [checked_value(parameter, c, f"LGreCo(choices[{i}])") for i, c in enumerate(choices)]
        keys = ["dense" if parameter.is_dense(c) else c for c in checked]
        if len(set(keys)) != len(keys):
            raise ValueError(f"LGreCo: choices must be distinct (None and the dense value are the same), "
                             f"got {checked!r}")
        reference = checked_value(parameter, reference, "LGreCo(reference)")
        matches = [i for i, c in enumerate(checked)
                   if c == reference or (parameter.is_dense(c) and parameter.is_dense(reference))]
        if not matches:
            raise ValueError(f"LGreCo: reference={reference!r} must be one of choices={checked!r}")
        self.choices = checked
        self.reference = reference
        self.reference_index = matches[0]
        self.interval = check_positive_int(interval, "interval", "LGreCo")
        self.budget = positive_number(budget, "budget", "LGreCo")
        self.resolution = check_positive_int(resolution, "resolution", "LGreCo", high=MAX_RESOLUTION)
        self.history = check_history(history, "LGreCo")
        self._configure(checked)
        for c in checked:
            try:
                bytes_sent(self.configured(c), REFERENCE_SHAPE, torch.float32)
            except NotImplementedError as err:
                raise ValueError(f"LGreCo: base {type(base).__name__} cannot predict its payload size, which "
                                 f"L-GreCo minimises ({err})") from None
        self.undo_log = UndoLog()
        self._accumulated = GradientAccumulator(self.undo_log)
        self._layouts: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._choice: dict[str, int] = {}
        self._history: dict[str, deque[tuple[int, Any]]] = {}
        self._solves: deque[dict[str, Any]] = bounded_records((), self.history)
        self._timing = {"measure_s": 0.0, "dp_s": 0.0, "broadcast_s": 0.0, "step_s": 0.0, "timed_steps": 0,
                        "solves": 0}
        self._last_end: float | None = None

    # -- decisions ------------------------------------------------------------------------------
    def choice_of(self, name: str) -> Any:
        """The parameter value of tensor ``name`` until the next solve."""
        return self.choices[self._choice.get(name, self.reference_index)]

    def value_for(self, tensor: torch.Tensor, name: str) -> Any:
        return self.choice_of(name)

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Hashable]:
        return {"choice": shown_value(self.choice_of(name))}

    def observe(self, name: str, aggregated: torch.Tensor) -> None:
        if self._accumulated.add(name, aggregated) and name not in self._layouts:
            self._layouts[name] = (aggregated.shape, aggregated.dtype)
            self._history[name] = bounded_records([(self.steps, self.choice_of(name))], self.history)

    def measure(self, names: Sequence[str]) -> tuple[list[list[float]], list[list[int]]]:
        """``e_l(c)`` and ``s_l(c)`` of every choice for the accumulated gradient of each of
        ``names``, on a deep copy of the base (the real one's state does not move)."""
        probe = copy.deepcopy(self.base)
        configured = [None if self.base.parameter.is_dense(c) else probe.with_value(c) for c in self.choices]
        errors, sizes = [], []
        for name in names:
            g = self._accumulated.sums[name]
            shape, dtype = self._layouts[name]
            e_row, s_row = [], []
            for concrete in configured:
                chosen = None if concrete is None else concrete.compressor_for(g, name)
                if chosen is None:
                    e_row.append(0.0)
                    s_row.append(bytes_sent(None, shape, dtype))
                    continue
                payload, ctx = chosen.compress(g, name)
                # One worker: the "sum over ranks" of each round is this payload itself.
                for _ in range(1, chosen.traits.rounds):
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
            # A broadcast from the backend's rank 0 as a sum with zeros (docs/DESIGN.md#adaptive-schedules).
            received = backend.wait(backend.allreduce_async(message, "lgreco.choices", average=False)).tolist()
            self._timing["broadcast_s"] += time.perf_counter() - started
            indices = [int(i) for i in received[: len(names)]]
            info = {**info, **dict(zip(("error", "budget", "bytes", "uniform_bytes"), received[len(names):],
                                       strict=True))}
            if any(not 0 <= i < len(self.choices) for i in indices):
                raise RuntimeError(f"LGreCo: rank 0 sent choice indices {indices} outside 0..{len(self.choices) - 1}")
        for name, index in zip(names, indices, strict=True):
            self._choice[name] = index
            changes = self._history.setdefault(name, bounded_records((), self.history))
            note_change(changes, self.steps, self.choices[index])
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
        self._history = {n: bounded_records((tuple(c) for c in changes), self.history)
                         for n, changes in state["history"].items()}
        self._solves = bounded_records((dict(s) for s in state["solves"]), self.history)
        self._timing = {"solves": len(self._solves), **state["timing"]}
        self._last_end = None

    def configuration(self) -> str:
        return (f"LGreCo({self.base!r}, choices={self.choices!r}, reference={self.reference!r}, "
                f"interval={self.interval}, budget={self.budget!r}, resolution={self.resolution})")

    def __repr__(self) -> str:
        # The choices' digest lets the consistency check catch a rank resumed from another state.
        return f"{self.configuration()[:-1]}, decisions={decisions_digest(sorted(self._choice.items()))})"
