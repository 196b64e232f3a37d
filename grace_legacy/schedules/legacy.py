"""LEGACY: set any compressor's parameter from the layer's size and the training phase."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch

from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.validation import ArgumentTypeError, check_increasing_positive_ints, check_positive_int
from grace_legacy.schedules.base import Schedule
from grace_legacy.schedules.budget import budget_matched as match_budget
from grace_legacy.schedules.flags import MODES, format_flags, parse_flags


class Legacy(Schedule):
    """Schedules ``base``'s parameter (``base`` built without it: ``TopK()``) by a table:

    * ``by="layer"``: ``splits = [s_0 < s_1 < ...]`` (elements) cut tensors into size groups; a
      tensor of ``n`` elements is in group ``i``, the first with ``n < s_i`` (the last if none), and
      uses ``values[i]``; ``len(values) == len(splits) + 1``.
    * ``by="epoch"``: ``P = len(values)`` phases. With ``epochs = E`` they are equal: progress ``e``
      is in phase ``i``, the first with ``e < (i + 1) * E / P`` (the last if none); with ``P - 1``
      increasing ``boundaries``, the first with ``e < b_i``.
    * ``by="both"``: ``values`` is a ``P x G`` table, one row per phase, one column per size group.

    ``None`` or the parameter's dense value (density ``1.0``) sends a tensor uncompressed. The choice
    depends only on the size and the progress (:class:`~grace_legacy.schedules.base.Schedule`), which
    every rank shares: no communication, a table lookup per tensor.
    """

    MODES = MODES

    def __init__(self, base: Compressor, by: str, values: Sequence[Any], *, splits: Sequence[int] | None = None,
                 epochs: int | None = None, boundaries: Sequence[int] | None = None,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__(base, steps_per_epoch=steps_per_epoch)
        if by not in self.MODES:
            raise ValueError(f"Legacy: by must be one of {', '.join(map(repr, self.MODES))}, got {by!r}")
        by_layer, by_phase = by in ("layer", "both"), by in ("epoch", "both")
        if by_layer and base.traits.spans_step:
            raise ValueError(f"Legacy: by={by!r} sets a value per layer, but {type(base).__name__} makes one selection "
                             f"over every layer of the step together, so no layer has a value of its own; use "
                             f"by='epoch', or a per-layer compressor (TopK) by layer")

        if by_layer:
            self.splits = check_increasing_positive_ints([] if splits is None else splits, "splits", "Legacy")
        elif splits is not None:
            raise ValueError(f"Legacy: splits is only used with by='layer' or by='both', not by={by!r}")
        else:
            self.splits = []

        if not isinstance(values, Sequence) or isinstance(values, str):
            raise ArgumentTypeError(f"Legacy: values must be a non-empty list, got {values!r}")
        if not values:
            raise ValueError(f"Legacy: values must be a non-empty list, got {values!r}")
        if by == "both":
            rows = list(values)
            if not all(isinstance(r, Sequence) and not isinstance(r, str) for r in rows):
                raise ArgumentTypeError("Legacy: by='both' needs values as a list of rows (one per phase), "
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

        self.table: list[list[Any]] = [[base.parameter.check(v, f"Legacy({where(p, g)})") for g, v in enumerate(row)]
                                       for p, row in enumerate(rows)]
        self.phases = len(self.table)

        if by_phase:
            if epochs is None and boundaries is None:
                raise ValueError(f"Legacy: by={by!r} needs epochs (the total number of epochs, for equal phases) "
                                 f"or boundaries (the epochs at which each phase after the first starts)")
            self.epochs = None if epochs is None else check_positive_int(epochs, "epochs", "Legacy")
            if boundaries is not None:
                self.boundaries = check_increasing_positive_ints(boundaries, "boundaries", "Legacy")
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

    def value_at(self, numel: int, progress: Fraction | int | None = None) -> Any:
        """The parameter value for a tensor of ``numel`` elements at ``progress`` (default: now)."""
        phase = self.phase_of(self.progress if progress is None else progress)
        return self.table[phase][self.group_of(numel)]

    def configured_at(self, phase: int, group: int) -> Compressor | None:
        """The configured base for size group ``group`` in phase ``phase``; ``None`` where dense."""
        return self.configured(self.table[phase][group])

    def value_for(self, tensor: torch.Tensor, name: str) -> Any:
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

    # -- other ways to build one ------------------------------------------------------------------
    @classmethod
    def from_flags(cls, base: Compressor, by: str, group_compressions: str, group_splits: str = "",
                   epochs: int | None = None, **kwargs: Any) -> Legacy:
        """The schedule the reference implementation's flags describe (read as
        :func:`~grace_legacy.schedules.flags.parse_flags` documents); ``kwargs`` go to :class:`Legacy`."""
        mode, values, options = parse_flags(base, by, group_compressions, group_splits, epochs)
        return cls(base, mode, values, **options, **kwargs)

    def to_flags(self) -> dict[str, Any]:
        """This schedule's reference flags: ``Legacy.from_flags(base, **schedule.to_flags())`` rebuilds it."""
        return format_flags(self.base.parameter.name == "ratio", self.by, self.table, self.splits, self.epochs)

    @classmethod
    def budget_matched(cls, base: Compressor, target: Any, *, by: str, **options: Any) -> Legacy:
        """A schedule of a given shape that sends as many bytes over the run as ``base`` at the
        uniform value ``target`` (:func:`grace_legacy.schedules.budget.budget_matched`, with its
        keyword arguments)."""
        if by not in cls.MODES:
            raise ValueError(f"Legacy.budget_matched: by must be one of {cls.MODES}, got {by!r}")
        return match_budget(cls, base, target, by=by, **options)

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
