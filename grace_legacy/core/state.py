"""What a compressor's or memory's state must promise: it is only loaded into the configuration
that saved it, and one step's change to it can be undone (a skipped step)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_ABSENT = object()

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
    """Raise ``ValueError`` naming every entry of a saved configuration that differs from ``now``
    (why: docs/CHECKPOINTING.md#what-is-refused)."""
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
    """A ``ValueError`` unless ``state`` was saved under ``configuration`` (one string)."""
    refuse_other_configuration(owner, {"config": saved_configuration(state, owner)}, {"config": configuration})

class UndoLog:
    """What per-tensor state held before this step changed it, so that a skipped step can be undone
    exactly. Call :meth:`remember` before replacing ``store[name]`` (state is replaced out of
    place, never written into); references are kept until :meth:`clear` ends the step."""

    def __init__(self) -> None:
        self._before: dict[tuple[int, str], tuple[dict, Any]] = {}

    def remember(self, store: dict, name: str) -> None:
        self._before.setdefault((id(store), name), (store, store.get(name, _ABSENT)))

    def undo(self, name: str) -> None:
        """Put back what every remembered store held for ``name`` before this step, and for its
        parts: state kept under ``name[start:stop]`` (a segment compressed on its own)."""
        part = f"{name}["
        for key in [key for key in self._before if key[1] == name or key[1].startswith(part)]:
            store, previous = self._before.pop(key)
            if previous is _ABSENT:
                store.pop(key[1], None)
            else:
                store[key[1]] = previous

    def names(self) -> set[str]:
        """The names whose state this step changed."""
        return {name for _, name in self._before}

    def clear(self) -> None:
        """The step is over: nothing of it will be undone."""
        self._before.clear()


class Stateful:
    """Checkpoint and undo, shared by compressors and memories: everything carried between steps is
    plain data in :meth:`state_dict` (``torch.load(..., weights_only=True)`` reads it), stamped with
    :meth:`configuration` and loaded only into an object configured alike. An object whose state a
    step changes keeps an :class:`UndoLog` in ``undo_log`` (docs/DESIGN.md#skipped-steps)."""

    undo_log: UndoLog | None = None

    def undo(self, name: str) -> None:
        """Undo this step's change to ``name``'s state: the step is skipped and leaves no trace."""
        if self.undo_log is not None:
            self.undo_log.undo(name)

    def end_step(self, backend: Any = None) -> None:
        """The step is over: what :meth:`undo` would restore is let go."""
        if self.undo_log is not None:
            self.undo_log.clear()

    def configuration(self) -> str:
        """What a saved state is only valid for: the arguments, as the ``repr``."""
        return repr(self)

    def state_dict(self) -> dict[str, Any]:
        """What carries over between steps (copies) and its :meth:`configuration`; subclasses add to
        ``super().state_dict()``."""
        return {"config": self.configuration()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse (``ValueError`` naming the difference) a ``state`` saved by another configuration;
        subclasses then load their entries. Call between steps."""
        refuse_other_state(state, f"{type(self).__name__}.load_state_dict", self.configuration())
        if self.undo_log is not None:
            self.undo_log.clear()
