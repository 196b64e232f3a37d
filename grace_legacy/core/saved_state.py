"""Refusing a saved state that another configuration produced.

A state is only meaningful for the set-up that produced it: a residual kept for Top-k at density
0.01, or a step counter of QSGD with seed 7, loaded into another set-up would resume a run that
never happened, silently. Every saved state therefore carries its owner's configuration (the
``repr`` of its arguments) and loading compares it first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_SEPARATORS = " ,()[]{}"


def _first_difference(saved: str, now: str) -> str:
    """The argument where two configuration strings first differ, e.g. ``'epochs=4' -> 'epochs=8'``."""
    start = 0
    while start < min(len(saved), len(now)) and saved[start] == now[start]:
        start += 1
    while start > 0 and saved[start - 1] not in _SEPARATORS:
        start -= 1

    def token(text: str) -> str:
        end = start
        while end < len(text) and (end == start or text[end] not in _SEPARATORS):
            end += 1
        return text[start:end]

    return f"{token(saved)!r} -> {token(now)!r}"


def refuse_other_configuration(owner: str, saved: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every entry of a saved configuration that differs from ``now``.

    A state is only meaningful for the set-up that produced it: a residual kept for Top-k at
    density 0.01, or a step counter of QSGD with seed 7, loaded into another set-up would resume
    a run that never happened, silently.
    """
    lines = []
    for key in sorted(set(saved) | set(now)):
        before, after = saved.get(key, "<missing>"), now.get(key, "<missing>")
        if before != after:
            where = f" (at {_first_difference(before, after)})" if isinstance(before, str) and isinstance(
                after, str) else ""
            lines.append(f"  {key}: saved {before}, now {after}{where}")
    if lines:
        raise ValueError(f"{owner}: this state was saved by a different configuration; loading it would "
                         f"resume a run that never happened:\n" + "\n".join(lines))


def saved_configuration(state: Any, owner: str) -> Any:
    """``state["config"]``, or a ``ValueError`` saying the object is not such a state."""
    if not isinstance(state, Mapping) or "config" not in state:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"{owner}: expected a state from {owner.split('.')[0]}.state_dict() (a dict with a "
                         f"'config' entry), got {got}")
    return state["config"]


def refuse_other_state(state: Any, owner: str, configuration: str) -> None:
    """A ``ValueError`` unless ``state`` is a state saved under ``configuration`` (a compressor's or
    a memory's, which is one string)."""
    refuse_other_configuration(owner, {"config": saved_configuration(state, owner)}, {"config": configuration})
