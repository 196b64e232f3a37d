"""Budget matching: a LEGACY schedule of a given shape that sends as many bytes over the run as
a uniform setting, so the user picks a shape and a familiar uniform value instead of a table."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from grace_legacy.core.compressor import Compressor
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.runtime.cost import bytes_sent, link_bytes
from grace_legacy.runtime.validation import (
    MAX_NUMEL,
    ArgumentTypeError,
    check_gradient_dtype,
    check_increasing_positive_ints,
    check_positive_int,
    checked_shapes,
    checked_value,
    positive_number,
)


class Table(Protocol):
    """What budget matching asks of a LEGACY schedule it builds."""

    def group_of(self, numel: int) -> int: ...
    def phase_weights(self) -> list[float]: ...
    def configured_at(self, phase: int, group: int) -> Compressor | None: ...


S = TypeVar("S", bound=Table)

#: The relative error between the schedule's bytes and the budget that ``budget_matched`` accepts.
TOLERANCE = ScheduledParameter("tolerance", low=0.0, high_inclusive=False)


def budget_matched(make: Callable[..., S], base: Compressor, target: Any, *, by: str, sizes: Iterable[int] | Any,
                   splits: Sequence[int] | None = None, layer_factors: Sequence[float] | None = None,
                   phase_factors: Sequence[float] | None = None, epochs: int | None = None,
                   boundaries: Sequence[int] | None = None, steps_per_epoch: int | None = None,
                   dtype: torch.dtype = torch.float32, tolerance: float = 0.01,
                   world_size: int | None = None, communicator: str | None = None) -> S:
    """A schedule of a given *shape* that sends as many bytes over the run as ``base`` at the
    uniform parameter ``target`` would.

    The shape is relative: ``layer_factors[g]`` multiplies the parameter of size group ``g`` and
    ``phase_factors[p]`` that of phase ``p`` (e.g. ``layer_factors=[10, 1]``: small layers get
    10x the density of large ones; ``phase_factors=[2, 1, 0.5]``). The schedule is

        value(p, g) = c * phase_factors[p] * layer_factors[g]    (dense once past the parameter's range)

    with the scale ``c`` found by bisection so that

        sum_p w_p * sum_l B(n_l, value(p, g(n_l)))  ==  sum_l B(n_l, target)

    where ``B(n, v)`` is what a tensor of ``n`` elements at parameter ``v`` costs: with
    ``world_size``, the link bytes per rank of the route a bundle takes for it among that many
    ranks (:func:`grace_legacy.runtime.cost.link_bytes`, dense where dense is cheaper): with no
    communicator named, or with ``communicator="auto"`` as ``Grace(communicator="auto")`` chooses;
    without, the bytes a rank hands to the backend (:func:`grace_legacy.runtime.cost.bytes_sent`).
    ``n_l`` ranges over the model's tensors (``sizes``: element counts, or
    ``model.named_parameters()``) and ``w_p`` is phase ``p``'s share of the run. Raises
    ``ValueError`` if no scale meets the budget within ``tolerance`` (relative).
    """
    parameter = base.parameter
    if parameter is None or parameter.integer or parameter.high is None:
        raise ValueError(f"Legacy.budget_matched: needs a bounded continuous parameter whose bytes grow with it (a "
                         f"density); {type(base).__name__}'s parameter is "
                         f"{f'{parameter.name}, {parameter.describe_range()}' if parameter else 'missing'}")
    owner = "Legacy.budget_matched"
    target = checked_value(parameter, target, f"{owner}(target)")
    numels = [size.numel() for size in checked_shapes(sizes, "sizes", owner)]
    if not any(numels):
        raise ValueError(f"{owner}: sizes has no tensor with elements")
    # What a mode does not use is refused, not dropped: a schedule without the shape asked for
    # would still match the budget, and nothing would show that the shape was lost.
    unused = {"layer": ("phase_factors", "epochs", "boundaries"), "epoch": ("splits", "layer_factors"),
              "both": ()}[by]
    given = {"splits": splits, "layer_factors": layer_factors, "phase_factors": phase_factors, "epochs": epochs,
             "boundaries": boundaries}
    for argument in unused:
        if given[argument] is not None:
            raise ValueError(f"{owner}: {argument} is not used with by={by!r}")
    if splits is not None:
        splits = check_increasing_positive_ints(splits, "splits", owner)
    groups = len(splits or []) + 1
    dtype = check_gradient_dtype(dtype, "dtype", owner)
    if tolerance is None:
        raise ArgumentTypeError(f"{owner}: tolerance must be {TOLERANCE.describe_range()}, got None")
    tolerance = checked_value(TOLERANCE, tolerance, owner)
    if world_size is not None:
        world_size = check_positive_int(world_size, "world_size", owner, high=MAX_NUMEL)
    if communicator not in (None, "auto"):
        raise ValueError(f"{owner}: communicator must be None (the route of the compressor's own aggregation) or "
                         f"'auto' (the route of fewest link bytes), got {communicator!r}")
    if communicator is not None and world_size is None:
        raise ValueError(f"{owner}: communicator={communicator!r} chooses routes by link bytes, which need world_size")
    byte_optimal = communicator == "auto"

    def factors(argument: str, given: Any, count: int | None) -> list[float]:
        if given is None:
            return [1.0] * (count or 1)
        if not isinstance(given, Sequence) or isinstance(given, str):
            raise ArgumentTypeError(f"{owner}: {argument} must be a list of finite numbers > 0, got {given!r}")
        checked = [positive_number(f, f"{argument}[{i}]", owner) for i, f in enumerate(given)]
        if not checked:
            raise ValueError(f"{owner}: {argument} must not be empty")
        if count is not None and len(checked) != count:
            raise ValueError(f"{owner}: {argument} needs {count} entr{'y' if count == 1 else 'ies'} (one per size "
                             f"group), got {len(checked)}")
        return checked

    layer_factors = factors("layer_factors", layer_factors, groups)
    phase_factors = factors("phase_factors", phase_factors, None)

    def build(scale: float) -> S:
        def value(p: int, g: int) -> Any:
            v = scale * phase_factors[p] * layer_factors[g]
            return parameter.dense if parameter.high is not None and v >= parameter.high else v

        table = [[value(p, g) for g in range(len(layer_factors))] for p in range(len(phase_factors))]
        values: Any = table if by == "both" else (table[0] if by == "layer" else [row[0] for row in table])
        kwargs: dict[str, Any] = {"steps_per_epoch": steps_per_epoch}
        if by != "epoch":
            kwargs["splits"] = splits or []
        if by != "layer":
            kwargs.update(epochs=epochs, boundaries=boundaries)
        return make(base, by, values, **kwargs)

    def cost(concrete: Compressor | None, numel: int) -> float:
        if world_size is None:
            return bytes_sent(concrete, numel, dtype)
        return link_bytes(concrete, numel, dtype, world_size, byte_optimal=byte_optimal)

    def run_bytes(schedule: S) -> float:
        return sum(weight * cost(schedule.configured_at(phase, schedule.group_of(n)), n)
                   for phase, weight in enumerate(schedule.phase_weights()) for n in numels)

    uniform = None if parameter.is_dense(target) else base.with_value(target)
    try:
        budget = sum(cost(uniform, n) for n in numels)
    except NotImplementedError as err:
        raise ValueError(f"Legacy.budget_matched: {type(base).__name__} cannot predict its bytes, so no budget "
                         f"can be matched ({err})") from None
    smallest = min(f * g for f in phase_factors for g in layer_factors)
    if not smallest > 0:  # two tiny factors whose product is below a float's range
        raise ValueError(f"{owner}: the products of layer_factors and phase_factors must be > 0 as floats; "
                         f"got factors {layer_factors} and {phase_factors}")
    low = 0.0
    high = parameter.high / smallest
    best, best_error = None, math.inf
    for _ in range(200):
        scale = (low + high) / 2
        if scale <= 0:
            break
        schedule = build(scale)
        spent = run_bytes(schedule)
        error = abs(spent - budget) / budget
        if error < best_error:
            best, best_error = schedule, error
        if spent < budget:
            low = scale
        else:
            high = scale
    if best is None or best_error > tolerance:
        raise ValueError(f"Legacy.budget_matched: no scale of this shape matches the budget of target={target} "
                         f"within {tolerance:.1%} (closest: {best_error:.2%}); widen the factors or the target")
    return best
