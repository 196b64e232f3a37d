"""The one parameter of a compressor that a schedule sets, and its range check."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ScheduledParameter:
    """The one parameter of a compressor that a schedule sets: accepted range ``low``/``high``
    (``None``: unbounded), whole numbers if ``integer``, and ``dense``, the value that means "send
    uncompressed" (``None`` always does)."""

    name: str
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    integer: bool = False
    dense: Any = None

    def describe_range(self) -> str:
        if self.integer and self.high is None and self.low is not None:
            return f"an integer >= {int(self.low)}"
        show = (lambda v: str(int(v))) if self.integer else (lambda v: f"{v:g}")
        left = ("[" if self.low_inclusive else "(") + ("-inf" if self.low is None else show(self.low))
        right = ("inf" if self.high is None else show(self.high)) + ("]" if self.high_inclusive else ")")
        kind = "an integer" if self.integer else "a number"
        return f"{kind} in {left}, {right}"

    def check(self, value: Any, owner: str) -> Any:
        """Return ``value`` if it is valid for this parameter, else raise naming ``owner``'s argument."""
        if value is None:
            return None
        where = f"{owner}: {self.name}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where} must be {self.describe_range()}, got {value!r} "
                            f"of type {type(value).__name__}")
        if isinstance(value, torch.Tensor):  # a 0-dim tensor is a Real only by accident
            raise TypeError(f"{where} must be a Python number, got a tensor")
        if isinstance(value, numbers.Integral):
            # Exact: float() of an int beyond ~1.8e308 raises OverflowError, not a clear ValueError.
            value = int(value)
            if not self.integer:
                value = _finite_float(value, where, self)
        else:
            given = value
            # A Fraction's float can round onto an integer (2**52 + 1/2 does): judge it exactly.
            fractional = isinstance(given, numbers.Rational) and given.denominator != 1
            value = _finite_float(given, where, self)
            if self.integer:
                if fractional or not value.is_integer():
                    raise ValueError(f"{where} must be {self.describe_range()}, got {given!r}")
                value = int(given) if isinstance(given, numbers.Rational) else int(value)
        too_low = self.low is not None and (value < self.low or (value == self.low and not self.low_inclusive))
        too_high = self.high is not None and (value > self.high or (value == self.high and not self.high_inclusive))
        if too_low or too_high:
            raise ValueError(f"{where} must be {self.describe_range()}, got {value!r}")
        return value

    def is_dense(self, value: Any) -> bool:
        return value is None or (self.dense is not None and value == self.dense)


def _finite_float(value: numbers.Real, where: str, parameter: ScheduledParameter) -> float:
    """``value`` as a finite float, or a ``ValueError`` naming the parameter's range."""
    try:
        converted = float(value)
    except OverflowError:  # an int or Fraction too large for a float
        converted = math.inf
    if not math.isfinite(converted):
        raise ValueError(f"{where} must be {parameter.describe_range()}, got {value!r}")
    return converted
