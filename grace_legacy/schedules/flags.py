"""The reference implementation's flags: LEGACY schedules written as the authors' code takes them."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from grace_legacy.core.compressor import Compressor


def parse_flags(base: Compressor, by: str, group_compressions: str, group_splits: str = "",
                epochs: int | None = None) -> tuple[str, list[Any], dict[str, Any]]:
    """Read the reference flags into ``Legacy``'s arguments ``(by, values, keyword arguments)``.
    ``group_compressions`` is comma-separated: densities (Top-k, Random-k, DGC) in *percent*
    (``"1,0.1"`` is 0.01 and 0.001; ``100`` is dense), other parameters in their own units, ``none``
    uncompressed; ``;`` separates the phases (rows) of ``by="both"``. ``group_splits``:
    comma-separated element counts. ``by="uniform"`` uses the first value everywhere."""
    if not isinstance(group_compressions, str) or not group_compressions.strip():
        raise ValueError(f"Legacy.from_flags: group_compressions must be a non-empty string, "
                         f"got {group_compressions!r}")
    parameter = base.parameter
    if parameter is None:
        raise ValueError(f"Legacy.from_flags: {type(base).__name__} has no parameter to schedule")
    percent = parameter.name == "ratio"

    def parse_value(token: str) -> Any:
        token = token.strip()
        if token.lower() in ("none", "dense"):
            return None
        try:
            number = Fraction(token)
        except ValueError:
            raise ValueError(f"Legacy.from_flags: cannot read {token!r} in group_compressions="
                             f"{group_compressions!r} as a number") from None
        if percent:
            return float(number / 100)
        return int(number) if parameter.integer and number.denominator == 1 else float(number)

    rows = [[parse_value(t) for t in row.split(",")] for row in group_compressions.split(";")]
    try:
        splits = [int(t) for t in group_splits.split(",")] if group_splits.strip() else []
    except ValueError:
        raise ValueError(f"Legacy.from_flags: group_splits must be comma-separated integers, "
                         f"got {group_splits!r}") from None
    if by == "uniform":
        return "layer", [rows[0][0]], {"splits": []}
    if by != "both" and len(rows) > 1:
        raise ValueError(f"Legacy.from_flags: ';' in group_compressions separates phases, only with by='both'; "
                         f"got group_compressions={group_compressions!r} with by={by!r}")
    if by == "layer":
        return "layer", rows[0], {"splits": splits}
    if by == "epoch":
        if splits:
            raise ValueError("Legacy.from_flags: group_splits is not used with by='epoch'")
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
