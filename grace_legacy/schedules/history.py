"""What the adaptive schedules keep of their decisions, bounded, and how they show them."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

from grace_legacy.core.seeds import derived_seed
from grace_legacy.runtime.validation import check_positive_int

#: How many records (parameter changes per tensor, solves, learning-rate drops) stats keep by default.
DEFAULT_HISTORY = 100


def check_history(history: Any, owner: str) -> int | None:
    if history is None:
        return None
    return check_positive_int(history, "history", owner, high=sys.maxsize)  # a deque's longest bound


def bounded_records(items: Iterable[Any], bound: int | None) -> deque:
    """The most recent ``bound`` of ``items`` (all of them for ``None``): a long run's history
    must not grow its memory step after step."""
    return deque(items, maxlen=bound)


def decisions_digest(decisions: Any) -> str:
    return f"{derived_seed(repr(decisions)):016x}"


def shown_value(value: Any) -> Hashable:
    """A parameter value as a stats key: ``"dense"`` for ``None``."""
    return "dense" if value is None else value


def note_change(changes: deque[tuple[int, Any]], step: int, value: Any) -> None:
    """Append ``(step, value)`` to a parameter history if the value changed; a second change at the same
    step (a boundary, then a learning-rate drop) replaces the first, which never took effect."""
    if changes and changes[-1][1] == value:
        return
    if changes and changes[-1][0] == step:
        changes.pop()
        if changes and changes[-1][1] == value:
            return
    changes.append((step, value))
