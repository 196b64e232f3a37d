"""The gradient an adaptive schedule sums between decisions, undoable for a skipped step."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.state import UndoLog
from grace_legacy.runtime.validation import nonfinite_flag


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class GradientAccumulator:
    """The sum of each tensor's finite aggregated gradients since the last :meth:`clear`, kept out
    of place so that a :class:`UndoLog` can undo one step's addition (a skipped step)."""

    def __init__(self, undo_log: UndoLog) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.undo_log = undo_log

    def add(self, name: str, aggregated: torch.Tensor) -> bool:
        """Add ``aggregated`` unless it holds an inf or NaN; return whether it was added."""
        if bool(nonfinite_flag(aggregated)):
            return False
        self.undo_log.remember(self.sums, name)
        self.undo_log.remember(self.counts, name)
        g = aggregated.detach().to(accumulation_dtype(aggregated.dtype))
        previous = self.sums.get(name)
        # A copy the first time: the optimizer may later scale or NaN-fill the gradient in place.
        self.sums[name] = g.clone() if previous is None else previous + g
        self.counts[name] = self.counts.get(name, 0) + 1
        return True

    def clear(self) -> None:
        self.sums.clear()
        self.counts.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"sums": {n: t.clone() for n, t in self.sums.items()}, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clear()
        self.sums.update({n: t.clone() for n, t in state["sums"].items()})
        self.counts.update(state["counts"])
