"""How long a rank waits for one collective before it raises :class:`RanksStalled`, naming the
collective and, where the backend can tell, the ranks it waits for (docs/DESIGN.md#stall-detection)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence

import torch

from grace_legacy.runtime.validation import ArgumentTypeError

#: The environment variable that sets the stall timeout (seconds) of every ``Grace`` bundle built
#: without an explicit ``stall_timeout``.
STALL_TIMEOUT_ENV = "GRACE_LEGACY_STALL_TIMEOUT"

#: The default: torch.distributed's default process-group timeout (docs/DESIGN.md#stall-detection).
DEFAULT_STALL_TIMEOUT_S = 1800.0


def resolve_stall_timeout(value: float | None = None) -> float:
    """``value``, else the :data:`STALL_TIMEOUT_ENV` variable, else :data:`DEFAULT_STALL_TIMEOUT_S`:
    a finite number of seconds > 0 (``ValueError`` otherwise)."""
    source = "stall_timeout"
    if value is None:
        setting = os.environ.get(STALL_TIMEOUT_ENV)
        if setting is None or not setting.strip():
            return DEFAULT_STALL_TIMEOUT_S
        source = STALL_TIMEOUT_ENV
        try:
            value = float(setting)
        except ValueError:
            raise ValueError(f"{STALL_TIMEOUT_ENV} must be a number of seconds > 0, got {setting!r}") from None
    accepted = (f"{source} must be a finite number of seconds > 0 (default {DEFAULT_STALL_TIMEOUT_S:g}, "
                f"or set {STALL_TIMEOUT_ENV}), got {value!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{accepted} of type {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond a float's range
        seconds = math.inf
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(accepted)
    return seconds


class RanksStalled(RuntimeError):
    """A collective did not complete within the stall timeout. ``collective``: its name;
    ``waited_s``: how long this rank waited; ``stalled_ranks``: the ranks that showed no sign of
    waiting themselves, or ``None`` if the backend could not tell; ``detail``: what it found out;
    ``tensors``: the gradients the collective carries, the one waited for first."""

    def __init__(self, rank: int, collective: str, waited_s: float, stalled_ranks: Sequence[int] | None,
                 detail: str, tensors: Sequence[str] = ()) -> None:
        self.rank, self.collective, self.waited_s = rank, collective, waited_s
        self.stalled_ranks = None if stalled_ranks is None else list(stalled_ranks)
        self.detail, self.tensors = detail, list(tensors)
        super().__init__(self._message())

    def carrying(self, tensors: Sequence[str]) -> RanksStalled:
        """The same error, naming the gradients the collective carries."""
        return RanksStalled(self.rank, self.collective, self.waited_s, self.stalled_ranks, self.detail, tensors)

    def _message(self) -> str:
        what = f"collective {self.collective!r}"
        if self.tensors:
            others = self.tensors[1:]
            what = (f"the gradient of {self.tensors[0]!r} ({what}"
                    + (f", fused with {', '.join(repr(t) for t in others[:8])}"
                       + (f" and {len(others) - 8} more" if len(others) > 8 else "") if others else "") + ")")
        if self.stalled_ranks is None:
            whom = "could not tell which ranks it waits for"
        elif not self.stalled_ranks:
            whom = "every other rank is waiting too"
        else:
            whom = f"it waits for rank{'s' if len(self.stalled_ranks) > 1 else ''} " \
                   f"{', '.join(str(r) for r in self.stalled_ranks)}"
        return (f"rank {self.rank} waited {self.waited_s:.1f} s for {what}; {whom}. {self.detail} "
                f"(the stall timeout is set by Grace(stall_timeout=...) or {STALL_TIMEOUT_ENV})")
