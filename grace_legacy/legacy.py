"""LEGACY: set any compressor's parameter from the layer's size and the training phase.

``Legacy(base, by=..., values=...)`` wraps a compressor built without its knob (``TopK()``,
``QSGD()``, ``PowerSGD()``) and, for every tensor at every step, picks the knob from a table:

* ``by="layer"``: ``splits = [s_0 < s_1 < ...]`` cut tensors into size groups. A tensor of ``n``
  elements is in group ``i``, the first with ``n < s_i`` (the last group if none), and uses
  ``values[i]``; ``len(values) == len(splits) + 1``.
* ``by="epoch"``: ``P = len(values)`` phases. With ``epochs = E`` they are equal: progress ``e``
  (in epochs) is in phase ``i``, the first with ``e < (i + 1) * E / P`` (the last if none). With
  ``boundaries = [b_0 < b_1 < ...]`` (``P - 1`` of them) phase ``i`` is the first with ``e < b_i``.
* ``by="both"``: ``values`` is a ``P x G`` table, one row per phase, one column per size group.

A value of ``None``, or the knob's own "dense" value (density ``1.0``), sends the tensor
uncompressed through a plain allreduce. The choice depends only on the tensor's size and on
training progress, which every rank shares, so every rank picks the same knob with no
communication and no computation beyond a table lookup.

Progress is the epoch given to :meth:`Legacy.set_epoch` (as with ``DistributedSampler``), or,
with ``steps_per_epoch=N``, the optimizer steps counted by :meth:`Legacy.end_step` divided by
``N`` (``hvd.DistributedOptimizer`` calls it after every synchronization).
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import torch

from grace_legacy.core import Compressor
from grace_legacy.grace import bytes_sent
from grace_legacy.schedule import KnobSchedule, check_positive_int, is_int

MODES = ("layer", "epoch", "both")


def _check_increasing_positive(values: Any, argument: str) -> list[int]:
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(f"Legacy: {argument} must be a list of integers, got {values!r}")
    if not all(is_int(v) for v in values):
        raise TypeError(f"Legacy: {argument} must be a list of integers, got {list(values)!r}")
    values = [int(v) for v in values]
    if any(v <= 0 for v in values) or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"Legacy: {argument} must be strictly increasing positive integers, got {values}")
    return values


class Legacy(KnobSchedule):
    """Wraps ``base`` and schedules its knob by layer size (``by="layer"``), training phase
    (``by="epoch"``) or both (``by="both"``); see the module docstring for the rules.

    Args:
        base: a compressor with a knob, built without a value for it (``TopK()``).
        by: ``"layer"``, ``"epoch"`` or ``"both"``.
        values: the knob values: a list (``layer``: one per size group; ``epoch``: one per phase)
            or, for ``both``, a list of rows (one per phase) of one value per size group.
        splits: size-group thresholds in elements (``layer``/``both``).
        epochs: total training epochs, for equal phases (``epoch``/``both``).
        boundaries: explicit phase starts in epochs, instead of equal phases.
        steps_per_epoch: count optimizer steps for progress, so ``set_epoch`` is optional.
    """

    def __init__(self, base: Compressor, by: str, values: Sequence[Any], *, splits: Sequence[int] | None = None,
                 epochs: int | None = None, boundaries: Sequence[int] | None = None,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__(base, steps_per_epoch=steps_per_epoch)
        if by not in MODES:
            raise ValueError(f"Legacy: by must be one of {', '.join(map(repr, MODES))}, got {by!r}")
        by_layer, by_phase = by in ("layer", "both"), by in ("epoch", "both")

        if by_layer:
            self.splits = _check_increasing_positive([] if splits is None else splits, "splits")
        elif splits is not None:
            raise ValueError(f"Legacy: splits is only used with by='layer' or by='both', not by={by!r}")
        else:
            self.splits = []

        if not isinstance(values, Sequence) or isinstance(values, str) or not values:
            raise ValueError(f"Legacy: values must be a non-empty list, got {values!r}")
        if by == "both":
            rows = list(values)
            if not all(isinstance(r, Sequence) and not isinstance(r, str) for r in rows):
                raise ValueError("Legacy: by='both' needs values as a list of rows (one per phase), "
                                 "each a list of one value per size group")
        elif by == "layer":
            rows = [list(values)]
        else:
            rows = [[v] for v in values]
        groups = len(self.splits) + 1
        for p, row in enumerate(rows):
            if len(row) != groups:
                where = f"values[{p}]" if by == "both" else "values"
                raise ValueError(f"Legacy: {where} needs len(splits) + 1 = {groups} entries (one per size group), "
                                 f"got {len(row)}")
        def where(p: int, g: int) -> str:
            return {"both": f"values[{p}][{g}]", "layer": f"values[{g}]", "epoch": f"values[{p}]"}[by]

        self.table: list[list[Any]] = [[base.knob.check(v, f"Legacy({where(p, g)})") for g, v in enumerate(row)]
                                       for p, row in enumerate(rows)]
        self.phases = len(self.table)

        if by_phase:
            if epochs is None and boundaries is None:
                raise ValueError(f"Legacy: by={by!r} needs epochs (the total number of epochs, for equal phases) "
                                 f"or boundaries (the epochs at which each phase after the first starts)")
            self.epochs = None if epochs is None else check_positive_int(epochs, "epochs", "Legacy")
            if boundaries is not None:
                self.boundaries = _check_increasing_positive(boundaries, "boundaries")
                if len(self.boundaries) != self.phases - 1:
                    raise ValueError(f"Legacy: boundaries needs one entry per phase after the first: "
                                     f"{self.phases - 1} for {self.phases} phases, got {len(self.boundaries)}")
                if self.epochs is not None and self.boundaries and self.boundaries[-1] >= self.epochs:
                    raise ValueError(f"Legacy: boundaries must be below epochs={self.epochs}, got {self.boundaries}")
            else:
                self.boundaries = None
        else:
            for argument, given in (("epochs", epochs), ("boundaries", boundaries)):
                if given is not None:
                    raise ValueError(f"Legacy: {argument} is only used with by='epoch' or by='both', not by='layer'")
            self.epochs, self.boundaries = None, None
        self.by = by
        # One configured copy per distinct value, built once: a step costs a table lookup.
        self._configure(v for row in self.table for v in row)
        # The phase changes only with progress, and the group only with the size: both are looked
        # up once, not per tensor and step (Fraction arithmetic costs microseconds).
        self._phase_now: tuple[tuple[int, int], int] | None = None
        self._group_by_numel: dict[int, int] = {}

    def with_knob(self, value: Any) -> Compressor:
        raise ValueError("Legacy sets its base's knob itself; change values= instead")

    # -- the rules ------------------------------------------------------------------------------
    def group_of(self, numel: int) -> int:
        """Size group of a tensor of ``numel`` elements: the first ``i`` with ``numel < splits[i]``."""
        return bisect.bisect_right(self.splits, numel)

    def phase_of(self, progress: Fraction | int) -> int:
        """Phase at ``progress`` epochs."""
        if self.phases == 1:
            return 0
        progress = Fraction(progress)
        if self.boundaries is not None:
            return bisect.bisect_right(self.boundaries, progress)
        return min(self.phases - 1, math.floor(progress * self.phases / self.epochs))

    def current_phase(self) -> int:
        """:meth:`phase_of` the current progress, computed once per progress."""
        at = (self.epoch, self.steps)
        if self._phase_now is None or self._phase_now[0] != at:
            self._phase_now = (at, self.phase_of(self.progress))
        return self._phase_now[1]

    def _group_of_numel(self, numel: int) -> int:
        group = self._group_by_numel.get(numel)
        if group is None:
            group = self._group_by_numel[numel] = self.group_of(numel)
        return group

    def knob_for(self, numel: int, progress: Fraction | int | None = None) -> Any:
        """The knob value for a tensor of ``numel`` elements at ``progress`` (default: now)."""
        phase = self.phase_of(self.progress if progress is None else progress)
        return self.table[phase][self.group_of(numel)]

    def _concrete(self, phase: int, group: int) -> Compressor | None:
        return self.concrete(self.table[phase][group])

    def knob_for_tensor(self, tensor: torch.Tensor, name: str) -> Any:
        return self.table[self.current_phase()][self._group_of_numel(tensor.numel())]

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Any]:
        labels = {}
        if self.by in ("layer", "both"):
            labels["group"] = self._group_of_numel(tensor.numel())
        if self.by in ("epoch", "both"):
            labels["phase"] = self.current_phase()
        return labels

    def __repr__(self) -> str:
        parts = [repr(self.base), f"by={self.by!r}"]
        values = self.table if self.by == "both" else (self.table[0] if self.by == "layer"
                                                        else [row[0] for row in self.table])
        parts.append(f"values={values!r}")
        if self.splits:
            parts.append(f"splits={self.splits!r}")
        if self.epochs is not None:
            parts.append(f"epochs={self.epochs}")
        if self.boundaries is not None:
            parts.append(f"boundaries={self.boundaries!r}")
        if self.steps_per_epoch is not None:
            parts.append(f"steps_per_epoch={self.steps_per_epoch}")
        return f"Legacy({', '.join(parts)})"

    # -- other ways to build one ----------------------------------------------------------------
    @classmethod
    def from_strings(cls, base: Compressor, by: str, group_compressions: str, group_splits: str = "",
                     epochs: int | None = None, **kwargs: Any) -> Legacy:
        """Read the reference implementation's flags.

        ``group_compressions`` is comma-separated; for a density knob (Top-k, Random-k, DGC) the
        values are *percentages* (``"1,0.1"`` is densities 0.01 and 0.001; ``100`` is dense), for
        other knobs they are the knob's own values; ``none`` means uncompressed. With
        ``by="both"``, ``;`` separates phases (rows). ``group_splits`` is comma-separated element
        counts. ``by="uniform"`` uses the first value for every tensor, as the reference does.
        """
        if not isinstance(group_compressions, str) or not group_compressions.strip():
            raise ValueError(f"Legacy.from_strings: group_compressions must be a non-empty string, "
                             f"got {group_compressions!r}")
        knob = base.knob
        if knob is None:
            raise ValueError(f"Legacy.from_strings: {type(base).__name__} has no parameter to schedule")
        percent = knob.name == "ratio"

        def parse_value(token: str) -> Any:
            token = token.strip()
            if token.lower() in ("none", "dense"):
                return None
            try:
                number = Fraction(token)
            except ValueError:
                raise ValueError(f"Legacy.from_strings: cannot read {token!r} in group_compressions="
                                 f"{group_compressions!r} as a number") from None
            if percent:
                return float(number / 100)
            return int(number) if knob.integer and number.denominator == 1 else float(number)

        rows = [[parse_value(t) for t in row.split(",")] for row in group_compressions.split(";")]
        try:
            splits = [int(t) for t in group_splits.split(",")] if group_splits.strip() else []
        except ValueError:
            raise ValueError(f"Legacy.from_strings: group_splits must be comma-separated integers, "
                             f"got {group_splits!r}") from None
        if by == "uniform":
            return cls(base, "layer", [rows[0][0]], splits=[])
        if by != "both" and len(rows) > 1:
            raise ValueError(f"Legacy.from_strings: ';' in group_compressions separates phases, only with by='both'; "
                             f"got group_compressions={group_compressions!r} with by={by!r}")
        if by == "layer":
            return cls(base, "layer", rows[0], splits=splits, **kwargs)
        if by == "epoch":
            if splits:
                raise ValueError("Legacy.from_strings: group_splits is not used with by='epoch'")
            return cls(base, "epoch", rows[0], epochs=epochs, **kwargs)
        return cls(base, by, rows, splits=splits, epochs=epochs, **kwargs)

    def to_strings(self) -> dict[str, Any]:
        """The reference flags for this schedule: ``Legacy.from_strings(base, **to_strings())``
        rebuilds it."""
        percent = self.base.knob.name == "ratio"

        def show(v: Any) -> str:
            if v is None:
                return "none"
            return f"{v * 100:.12g}" if percent else f"{v:g}"

        if self.by == "layer":
            text = ",".join(show(v) for v in self.table[0])
        elif self.by == "epoch":
            text = ",".join(show(row[0]) for row in self.table)
        else:
            text = ";".join(",".join(show(v) for v in row) for row in self.table)
        out: dict[str, Any] = {"by": self.by, "group_compressions": text,
                               "group_splits": ",".join(str(s) for s in self.splits)}
        if self.epochs is not None:
            out["epochs"] = self.epochs
        return out

    @classmethod
    def budget_matched(cls, base: Compressor, target: Any, *, by: str, sizes: Iterable[int] | Any,
                       splits: Sequence[int] | None = None, layer_factors: Sequence[float] | None = None,
                       phase_factors: Sequence[float] | None = None, epochs: int | None = None,
                       boundaries: Sequence[int] | None = None, steps_per_epoch: int | None = None,
                       dtype: torch.dtype = torch.float32, tolerance: float = 0.01,
                       world_size: int | None = None) -> Legacy:
        """A schedule of a given *shape* that sends as many bytes over the run as ``base`` at the
        uniform knob ``target`` would.

        The shape is relative: ``layer_factors[g]`` multiplies the knob of size group ``g`` and
        ``phase_factors[p]`` that of phase ``p`` (e.g. ``layer_factors=[10, 1]``: small layers get
        10x the density of large ones; ``phase_factors=[2, 1, 0.5]``). The schedule is

            value(p, g) = c * phase_factors[p] * layer_factors[g]    (dense once past the knob's range)

        with the scale ``c`` found by bisection so that

            sum_p w_p * sum_l B(n_l, value(p, g(n_l)))  ==  sum_l B(n_l, target)

        where ``B(n, v)`` is the exact number of bytes a rank hands to the backend for a tensor of
        ``n`` elements at knob ``v`` on the default route (:func:`grace_legacy.grace.bytes_sent`),
        ``n_l`` ranges over the model's tensors (``sizes``: element counts, or
        ``model.named_parameters()``) and ``w_p`` is phase ``p``'s share of the run. Give
        ``world_size`` (the number of ranks) to count tensors that the bundle's dense fallback
        sends dense as dense, as they will be. Raises ``ValueError`` if no scale meets the budget
        within ``tolerance`` (relative).
        """
        knob = base.knob
        if knob is None or knob.integer or knob.high is None:
            raise ValueError(f"Legacy.budget_matched: needs a bounded continuous knob whose bytes grow with it (a "
                             f"density); {type(base).__name__}'s knob is "
                             f"{f'{knob.name}, {knob.describe_range()}' if knob else 'missing'}")
        target = knob.check(target, "Legacy.budget_matched(target)")
        numels = [int(s[1].numel()) if isinstance(s, tuple) else int(s) for s in sizes]
        if not numels:
            raise ValueError("Legacy.budget_matched: sizes is empty")
        if by not in MODES:
            raise ValueError(f"Legacy.budget_matched: by must be one of {MODES}, got {by!r}")
        layer_factors = list(layer_factors) if layer_factors is not None else [1.0] * (len(splits or []) + 1)
        phase_factors = list(phase_factors) if phase_factors is not None else [1.0]
        if by == "epoch":
            layer_factors = [1.0]
        if by == "layer":
            phase_factors = [1.0]
        for argument, factors in (("layer_factors", layer_factors), ("phase_factors", phase_factors)):
            if not factors or any(not isinstance(f, numbers.Real) or not f > 0 for f in factors):
                raise ValueError(f"Legacy.budget_matched: {argument} must be positive numbers, got {factors}")
        def build(scale: float) -> Legacy:
            def value(p: int, g: int) -> Any:
                v = scale * phase_factors[p] * layer_factors[g]
                return knob.dense if knob.high is not None and v >= knob.high else v

            table = [[value(p, g) for g in range(len(layer_factors))] for p in range(len(phase_factors))]
            values: Any = table if by == "both" else (table[0] if by == "layer" else [row[0] for row in table])
            kwargs: dict[str, Any] = {"steps_per_epoch": steps_per_epoch}
            if by != "epoch":
                kwargs["splits"] = splits or []
            if by != "layer":
                kwargs.update(epochs=epochs, boundaries=boundaries)
            return cls(base, by, values, **kwargs)

        def run_bytes(schedule: Legacy) -> float:
            return sum(weight * bytes_sent(schedule._concrete(phase, schedule.group_of(n)), n, dtype, world_size)
                       for phase, weight in enumerate(schedule.phase_weights()) for n in numels)

        uniform = None if knob.is_dense(target) else base.with_knob(target)
        try:
            budget = sum(bytes_sent(uniform, n, dtype, world_size) for n in numels)
        except NotImplementedError as err:
            raise ValueError(f"Legacy.budget_matched: {type(base).__name__} cannot predict its bytes, so no budget "
                             f"can be matched ({err})") from None
        smallest = min(f * g for f in phase_factors for g in layer_factors)
        low = 0.0
        high = knob.high / smallest
        best, best_error = None, math.inf
        for _ in range(200):
            scale = (low + high) / 2
            if scale <= 0:
                break
            schedule = build(scale)
            spent = run_bytes(schedule)
            error = abs(spent - budget) / budget
            if error < best_error:
                best, best_error = schedule, error
            if spent < budget:
                low = scale
            else:
                high = scale
        if best is None or best_error > tolerance:
            raise ValueError(f"Legacy.budget_matched: no scale of this shape matches the budget of target={target} "
                             f"within {tolerance:.1%} (closest: {best_error:.2%}); widen the factors or the target")
        return best

    def phase_weights(self) -> list[float]:
        """Each phase's share of the run (equal phases, or from ``boundaries`` and ``epochs``)."""
        if self.phases == 1:
            return [1.0]
        if self.boundaries is None:
            return [1.0 / self.phases] * self.phases
        if self.epochs is None:
            raise ValueError("Legacy: phase shares need epochs when boundaries are given")
        edges = [0, *self.boundaries, self.epochs]
        return [(b - a) / self.epochs for a, b in zip(edges, edges[1:], strict=False)]
