"""Checks of user input shared by every layer: a bad argument fails where it is given, with an error
that names it and the accepted range."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
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


def check_positive_int(value: Any, argument: str, owner: str, *, high: int | None = None) -> int:
    """``value`` as an int if it is a whole number in ``[1, high]`` (no bound for ``None``); a
    ``TypeError`` (:class:`ArgumentTypeError`) for a non-number, else a ``ValueError``."""
    accepted = "a positive integer" if high is None else f"an integer in [1, {high}]"
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, torch.Tensor)):
        raise ArgumentTypeError(f"{owner}: {argument} must be {accepted}, got {value!r} "
                                f"of type {type(value).__name__}")
    if not is_int(value) or value <= 0 or (high is not None and value > high):
        raise ValueError(f"{owner}: {argument} must be {accepted}, got {value!r}")
    return int(value)


def check_flag(value: Any, argument: str, owner: str) -> bool:
    """``value`` if it is ``True`` or ``False``: a string such as ``"False"`` is truthy, so anything
    else is refused rather than read as a truth value."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{owner}: {argument} must be True or False, got {value!r} "
                                f"of type {type(value).__name__}")
    return value


def check_gradient_dtype(dtype: Any, argument: str, owner: str) -> torch.dtype:
    """``dtype`` if it is one of :data:`GRADIENT_DTYPES`."""
    accepted = "torch.float32, torch.float64, torch.float16 or torch.bfloat16"
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"{owner}: {argument} must be {accepted}, got {dtype!r} of type {type(dtype).__name__}")
    if dtype not in _ACCEPTED_DTYPES:
        raise ValueError(f"{owner}: {argument} must be {accepted}, got {dtype}")
    return dtype


def check_increasing_positive_ints(values: Any, argument: str, owner: str) -> list[int]:
    """``values`` as a list of ints if it is a sequence of strictly increasing positive integers."""
    if not isinstance(values, Sequence) or isinstance(values, str) or not all(is_int(v) for v in values):
        raise ArgumentTypeError(f"{owner}: {argument} must be a list of integers, got {values!r}")
    values = [int(v) for v in values]
    if any(v <= 0 for v in values) or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"{owner}: {argument} must be strictly increasing positive integers, got {values}")
    return values


#: The most elements a tensor can hold: PyTorch counts them in an int64.
MAX_NUMEL = 2**63 - 1


def checked_shapes(shapes: Any, argument: str, owner: str) -> list[torch.Size]:
    """The shapes of ``shapes``: an iterable of element counts (ints >= 0), shapes (sequences of
    ints >= 0) or ``(name, shape or tensor)`` pairs, as ``model.named_parameters()`` gives. A
    shape of more than :data:`MAX_NUMEL` elements is refused (``torch.Size.numel`` would wrap
    around to a negative count)."""
    if isinstance(shapes, (str, bytes, torch.Tensor)) or not isinstance(shapes, Iterable):
        raise ArgumentTypeError(f"{owner}: {argument} must be a list of element counts, shapes or (name, tensor) "
                                f"pairs, got {shapes!r} of type {type(shapes).__name__}")
    out = []
    for i, entry in enumerate(shapes):
        where = f"{owner}: {argument}[{i}]"
        if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
            entry = entry[1].shape if isinstance(entry[1], torch.Tensor) else entry[1]
        dims = [entry] if is_int(entry) else entry
        if (isinstance(dims, (str, bytes, torch.Tensor)) or not isinstance(dims, Sequence)
                or not all(is_int(d) for d in dims)):
            raise ArgumentTypeError(f"{where} must be an element count, a shape (integers) or a (name, tensor) "
                                    f"pair, got {entry!r} of type {type(entry).__name__}")
        if any(d < 0 for d in dims) or math.prod(int(d) for d in dims) > MAX_NUMEL:
            raise ValueError(f"{where} must have dimensions >= 0 and at most 2**63 - 1 elements, got {entry!r}")
        out.append(torch.Size([int(d) for d in dims]))
    return out


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
    try:
        converted = float(value)
    except OverflowError:  # an int or Fraction beyond a float's range
        converted = math.inf
    if not math.isfinite(converted) or not converted > 0:
        raise ValueError(f"{owner}: {argument} must be a finite number > 0, got {value!r}")
    return converted


def required(parameter: ScheduledParameter, value: Any, owner: str) -> Any:
    """A constructor argument checked against ``parameter``'s range, ``None`` refused: the
    ``ValueError`` or :class:`ArgumentTypeError` names the argument and the range."""
    if value is None:
        raise ArgumentTypeError(f"{owner}: {parameter.name} must be {parameter.describe_range()}, got None")
    return checked_value(parameter, value, owner)
