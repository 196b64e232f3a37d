"""DGC's warm-up: the parameter moves exponentially from dense to its target over the first epochs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from typing import Any

import torch

from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.validation import ArgumentTypeError, checked_value, is_int, positive_number
from grace_legacy.schedules.base import Schedule

#: The longest warm-up. Each warm-up epoch has its own value and configured copy of the base, all
#: built at construction, so a count in the millions would stall there and hold as many copies.
MAX_WARMUP_EPOCHS = 10_000


class DGCWarmup(Schedule):
    """Deep Gradient Compression's warm-up (Lin, Han, Mao, Wang and Dally, ICLR 2018): for epoch
    ``e`` (0-based, the whole epochs of the progress) and ``W = warmup_epochs``,

        value(e) = start * c ** (e + 1)      for e < W, clamped so that it never passes target
        value(e) = target                    for e >= W
        c        = (target / start) ** (1 / (W + 1))     unless coeff= gives c

    ``start`` defaults to a density's dense ``1.0``, giving the DGC reference's
    ``max(target ** ((e + 1) / (W + 1)), target)``; the paper's "25%, 6.25%, 1.5625%, 0.4%, then
    0.1%" is ``coeff=0.25``. Integer parameters are rounded to the nearest integer and need a
    ``start`` (``DGCWarmup(QSGD(), target=4, start=256)``: 111, 49, 21, 9, then 4 levels), as does
    Threshold, whose threshold then grows towards ``target``."""

    def __init__(self, base: Compressor, target: Any, warmup_epochs: int = 4, *, start: Any = None,
                 coeff: float | None = None, steps_per_epoch: int | None = None) -> None:
        super().__init__(base, steps_per_epoch=steps_per_epoch)
        parameter = base.parameter
        target = checked_value(parameter, target, "DGCWarmup(target)")
        if target is None or parameter.is_dense(target):
            raise ValueError(f"DGCWarmup: target must be a value that compresses, got {target!r}")
        if start is None:
            if not isinstance(parameter.dense, numbers.Real):
                raise ValueError(f"DGCWarmup: start is needed for {type(base).__name__}'s {parameter.name} (it has no "
                                 f"dense value to start from); e.g. DGCWarmup({type(base).__name__}(), target="
                                 f"{target!r}, start=...)")
            start = parameter.dense
        start = checked_value(parameter, start, "DGCWarmup(start)")
        if start is None:
            raise ValueError("DGCWarmup: start must be a number")
        for argument, value in (("target", target), ("start", start)):
            if not value > 0:
                raise ValueError(f"DGCWarmup: {argument} must be > 0 (the warm-up is geometric), got {value!r}")
        accepted = f"DGCWarmup: warmup_epochs must be an integer in [0, {MAX_WARMUP_EPOCHS}], got {warmup_epochs!r}"
        if not isinstance(warmup_epochs, numbers.Real) or isinstance(warmup_epochs, (bool, torch.Tensor)):
            raise ArgumentTypeError(f"{accepted} of type {type(warmup_epochs).__name__}")
        if not is_int(warmup_epochs) or not 0 <= warmup_epochs <= MAX_WARMUP_EPOCHS:
            raise ValueError(accepted)
        if coeff is not None:
            coeff = positive_number(coeff, "coeff", "DGCWarmup")
            if (target < start and not coeff < 1) or (target > start and not coeff > 1):
                raise ValueError(f"DGCWarmup: coeff={coeff!r} moves away from target={target!r} "
                                 f"(start={start!r}); it must be {'< 1' if target < start else '> 1'}")
        self.target, self.start, self.warmup_epochs, self.coeff = target, start, int(warmup_epochs), coeff
        self.values: list[Any] = [self._warmup_value(e) for e in range(self.warmup_epochs)] + [target]
        self._configure(self.values)

    def _warmup_value(self, epoch: int) -> Any:
        low, high = min(self.start, self.target), max(self.start, self.target)
        if self.coeff is None:
            value = self.start * (self.target / self.start) ** ((epoch + 1) / (self.warmup_epochs + 1))
        else:
            value = self.start * self.coeff ** (epoch + 1)
        value = min(high, max(low, value))
        if self.base.parameter.integer:
            value = min(high, max(low, math.floor(value + 0.5)))
        return self.base.parameter.check(value, "DGCWarmup")

    def phase_of(self, epoch: int) -> int:
        """Index into :attr:`values` at ``epoch``: the epoch itself during the warm-up, then ``W``."""
        return min(int(epoch), self.warmup_epochs)

    def value_at(self, epoch: int) -> Any:
        """The parameter value at epoch ``epoch``."""
        return self.values[self.phase_of(epoch)]

    def value_for(self, tensor: torch.Tensor, name: str) -> Any:
        return self.value_at(math.floor(self.progress))

    def traffic_labels(self, name: str, tensor: torch.Tensor) -> dict[str, Hashable]:
        return {"phase": self.phase_of(math.floor(self.progress))}

    @property
    def stats(self) -> dict[str, Any]:
        epoch = math.floor(self.progress)
        return {**super().stats, "warmup": {"values": list(self.values), "epoch": epoch,
                                            "phase": self.phase_of(epoch), "current": self.value_at(epoch)}}

    def __repr__(self) -> str:
        parts = [repr(self.base), f"target={self.target!r}", f"warmup_epochs={self.warmup_epochs}",
                 f"start={self.start!r}"]
        if self.coeff is not None:
            parts.append(f"coeff={self.coeff!r}")
        if self.steps_per_epoch is not None:
            parts.append(f"steps_per_epoch={self.steps_per_epoch}")
        return f"DGCWarmup({', '.join(parts)})"
