"""The reference implementation's flags: LEGACY schedules written as the authors' code takes them.

``--group_compressions`` lists the knob values, comma-separated: for a density knob (Top-k,
Random-k, DGC) in *percent* (``"1,0.1"`` is densities 0.01 and 0.001; ``100`` is dense), for other
knobs the knob's own values; ``none`` means uncompressed. With ``by="both"``, ``;`` separates
phases (rows). ``--group_splits`` lists the size-group thresholds in elements.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

from grace_legacy.core.compressor import Compressor
from grace_legacy.core.validation import ArgumentTypeError

if TYPE_CHECKING:
    from grace_legacy.schedules.legacy import Legacy


def from_flags(cls: type[Legacy], base: Compressor, by: str, group_compressions: str, group_splits: str = "",
                 epochs: int | None = None, **kwargs: Any) -> Legacy:
    """Read the reference implementation's flags.

    ``group_compressions`` is comma-separated; for a density knob (Top-k, Random-k, DGC) the
    values are *percentages* (``"1,0.1"`` is densities 0.01 and 0.001; ``100`` is dense), for
    other knobs they are the knob's own values; ``none`` means uncompressed. With
    ``by="both"``, ``;`` separates phases (rows). ``group_splits`` is comma-separated element
    counts. ``by="uniform"`` uses the first value for every tensor, as the reference does.
    """
    for argument, text in (("group_compressions", group_compressions), ("group_splits", group_splits)):
        if not isinstance(text, str):
            raise ArgumentTypeError(f"Legacy.from_strings: {argument} must be a string, got {text!r} "
                                    f"of type {type(text).__name__}")
    if not group_compressions.strip():
        raise ValueError(f"Legacy.from_strings: group_compressions must be a non-empty string, "
                         f"got {group_compressions!r}")
    if by not in ("uniform", *cls.MODES):
        raise ValueError(f"Legacy.from_strings: by must be one of 'uniform', {', '.join(map(repr, cls.MODES))}, "
                         f"got {by!r}")
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
        if knob.integer and not percent and number.denominator == 1:
            return int(number)  # exact, however large: the knob's own check judges its range
        try:
            return float(number / 100) if percent else float(number)
        except OverflowError:
            raise ValueError(f"Legacy.from_strings: {token!r} in group_compressions={group_compressions!r} is "
                             f"beyond a float's range") from None

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


def to_flags(schedule: Legacy) -> dict[str, Any]:
    """The reference flags for this schedule: ``Legacy.from_strings(base, **to_strings())``
    rebuilds it."""
    percent = schedule.base.knob.name == "ratio"

    def show(v: Any) -> str:
        if v is None:
            return "none"
        return f"{v * 100:.12g}" if percent else f"{v:g}"

    if schedule.by == "layer":
        text = ",".join(show(v) for v in schedule.table[0])
    elif schedule.by == "epoch":
        text = ",".join(show(row[0]) for row in schedule.table)
    else:
        text = ";".join(",".join(show(v) for v in row) for row in schedule.table)
    out: dict[str, Any] = {"by": schedule.by, "group_compressions": text,
                           "group_splits": ",".join(str(s) for s in schedule.splits)}
    if schedule.epochs is not None:
        out["epochs"] = schedule.epochs
    return out
