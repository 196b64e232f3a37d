"""Undoing one step's change to per-tensor state, for steps that end up skipped."""

from __future__ import annotations

from typing import Any

_ABSENT = object()


class StepJournal:
    """What per-tensor state held before this step changed it, so that a skipped step (a
    non-finite gradient on some rank) can be undone exactly.

    Call :meth:`remember` before replacing ``store[name]``. Only references are kept, which is
    sound because state is replaced out of place, never written into, and only until
    :meth:`commit` at the end of the step: the cost is at most one extra copy of the state while
    a step is in flight. A compressor or memory that owns ``self._journal`` gets working
    ``rollback``/``commit`` from its base class.
    """

    def __init__(self) -> None:
        self._before: dict[tuple[int, str], tuple[dict, Any]] = {}

    def remember(self, store: dict, name: str) -> None:
        self._before.setdefault((id(store), name), (store, store.get(name, _ABSENT)))

    def rollback(self, name: str) -> None:
        for key in [key for key in self._before if key[1] == name]:
            store, previous = self._before.pop(key)
            if previous is _ABSENT:
                store.pop(name, None)
            else:
                store[name] = previous

    def commit(self) -> None:
        self._before.clear()
