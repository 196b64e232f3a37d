"""Checks of user input shared by every layer: a bad argument fails where it is given, with an error
that names it and the accepted range."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from grace_legacy.core.parameter import ScheduledParameter


#: The gradient dtypes every compressor encodes. float8 types are floating point too, but
#: PyTorch implements too few operations on them (abs, topk, norms) for any compressor.
GRADIENT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a ``TypeError`` by Python's convention, and a ``ValueError``
    like every other invalid argument, so that either ``except`` catches it."""


_ACCEPTED_DTYPES = frozenset(GRADIENT_DTYPES)


def check_gradient(tensor: torch.Tensor, owner: str) -> None:
    """Reject what no compressor can encode, with an error that says what was wrong."""
    # Every gradient of every step passes here: a valid one is accepted by one combined test,
    # and only a rejected one pays for finding out which rule it broke.
    if (isinstance(tensor, torch.Tensor) and tensor.dtype in _ACCEPTED_DTYPES and tensor.layout is torch.strided
            and tensor.numel()):
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{owner}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{owner}: gradients must be floating point, got dtype {tensor.dtype}")
    if tensor.dtype not in GRADIENT_DTYPES:
        raise TypeError(f"{owner}: gradients must be float32, float64, float16 or bfloat16, got {tensor.dtype}")
    if tensor.numel() == 0:
        raise ValueError(f"{owner}: cannot compress an empty tensor (shape {tuple(tensor.shape)})")
    if tensor.layout is not torch.strided:
        raise TypeError(f"{owner}: sparse tensors ({tensor.layout}) are not supported; densify the gradient first")


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: whether ``tensor`` holds an inf or a NaN (``False`` when empty), the same
    answer as ``~torch.isfinite(tensor).all()`` from one ``aminmax`` pass, without synchronizing."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    low, high = torch.aminmax(tensor.detach())
    return ~(torch.isfinite(low) & torch.isfinite(high))


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(value: Any, argument: str, owner: str) -> int:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ArgumentTypeError(f"{owner}: {argument} must be a positive integer, got {value!r} "
                                f"of type {type(value).__name__}")
    if not is_int(value) or value <= 0:
        raise ValueError(f"{owner}: {argument} must be a positive integer, got {value!r}")
    return int(value)


def checked_value(parameter: ScheduledParameter, value: Any, where: str) -> Any:
    """``parameter.check(value, where)``, whose type errors are also ``ValueError``s (:class:`ArgumentTypeError`)."""
    try:
        return parameter.check(value, where)
    except TypeError as err:
        raise ArgumentTypeError(str(err)) from None


def positive_number(value: Any, argument: str, owner: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{owner}: {argument} must be a finite number > 0, got {value!r} "
                                f"of type {type(value).__name__}")
    if not math.isfinite(float(value)) or not value > 0:
        raise ValueError(f"{owner}: {argument} must be a finite number > 0, got {value!r}")
    return float(value)
