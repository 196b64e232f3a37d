"""The reference implementation's flags: LEGACY schedules written as the authors' code takes them."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.validation import ArgumentTypeError

#: LEGACY's modes (``Legacy.MODES``); the flags add ``"uniform"``.
MODES = ("layer", "epoch", "both")


def parse_flags(base: Compressor, by: str, group_compressions: str, group_splits: str = "",
                epochs: int | None = None) -> tuple[str, list[Any], dict[str, Any]]:
    """Read the reference flags into ``Legacy``'s arguments ``(by, values, keyword arguments)``.
    ``group_compressions`` is comma-separated: densities (Top-k, Random-k, DGC) in *percent*
    (``"1,0.1"`` is 0.01 and 0.001; ``100`` is dense), other parameters in their own units, ``none``
    uncompressed; ``;`` separates the phases (rows) of ``by="both"``. ``group_splits``:
    comma-separated element counts. ``by="uniform"`` uses the first value everywhere."""
    owner = "Legacy.from_flags"
    for argument, text in (("group_compressions", group_compressions), ("group_splits", group_splits)):
        if not isinstance(text, str):
            raise ArgumentTypeError(f"{owner}: {argument} must be a string, got {text!r} of type {type(text).__name__}")
    if not group_compressions.strip():
        raise ValueError(f"{owner}: group_compressions must be a non-empty string, got {group_compressions!r}")
    if by not in ("uniform", *MODES):
        raise ValueError(f"{owner}: by must be one of 'uniform', {', '.join(map(repr, MODES))}, got {by!r}")
    parameter = base.parameter
    if parameter is None:
        raise ValueError(f"{owner}: {type(base).__name__} has no parameter to schedule")
    percent = parameter.name == "ratio"

    def parse_value(token: str) -> Any:
        token = token.strip()
        if token.lower() in ("none", "dense"):
            return None
        try:
            number = Fraction(token)
        except ValueError:
            raise ValueError(f"{owner}: cannot read {token!r} in group_compressions={group_compressions!r} "
                             f"as a number") from None
        if parameter.integer and not percent and number.denominator == 1:
            return int(number)  # exact, however large: the parameter's own check judges its range
        try:
            return float(number / 100) if percent else float(number)
        except OverflowError:
            raise ValueError(f"{owner}: {token!r} in group_compressions={group_compressions!r} is beyond a "
                             f"float's range") from None

    rows = [[parse_value(t) for t in row.split(",")] for row in group_compressions.split(";")]
    try:
        splits = [int(t) for t in group_splits.split(",")] if group_splits.strip() else []
    except ValueError:
        raise ValueError(f"{owner}: group_splits must be comma-separated integers, got {group_splits!r}") from None
    if by == "uniform":
        return "layer", [rows[0][0]], {"splits": []}
    if by != "both" and len(rows) > 1:
        raise ValueError(f"{owner}: ';' in group_compressions separates phases, only with by='both'; "
                         f"got group_compressions={group_compressions!r} with by={by!r}")
    if by == "layer":
        return "layer", rows[0], {"splits": splits}
    if by == "epoch":
        if splits:
            raise ValueError(f"{owner}: group_splits is not used with by='epoch'")
        return "epoch", rows[0], {"epochs": epochs}
    return by, rows, {"splits": splits, "epochs": epochs}


def format_flags(percent: bool, by: str, table: list[list[Any]], splits: list[int],
                 epochs: int | None) -> dict[str, Any]:
    """The reference flags of a LEGACY table (``percent``: the values are densities, written in
    percent); :func:`parse_flags` reads them back."""

    def show(v: Any) -> str:
        if v is None:
            return "none"
        return f"{v * 100:.12g}" if percent else f"{v:g}"

    if by == "layer":
        text = ",".join(show(v) for v in table[0])
    elif by == "epoch":
        text = ",".join(show(row[0]) for row in table)
    else:
        text = ";".join(",".join(show(v) for v in row) for row in table)
    out: dict[str, Any] = {"by": by, "group_compressions": text, "group_splits": ",".join(str(s) for s in splits)}
    if epochs is not None:
        out["epochs"] = epochs
    return out
