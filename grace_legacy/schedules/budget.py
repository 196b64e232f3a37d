"""Budget matching: a LEGACY schedule of a given shape that sends as many bytes over the run as
a uniform setting, so the user picks a shape and a familiar uniform value instead of a table."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.cost import bytes_sent


class Table(Protocol):
    """What budget matching asks of a LEGACY schedule it builds."""

    def group_of(self, numel: int) -> int: ...
    def phase_weights(self) -> list[float]: ...
    def configured_at(self, phase: int, group: int) -> Compressor | None: ...


S = TypeVar("S", bound=Table)


def budget_matched(make: Callable[..., S], base: Compressor, target: Any, *, by: str, sizes: Iterable[int] | Any,
                   splits: Sequence[int] | None = None, layer_factors: Sequence[float] | None = None,
                   phase_factors: Sequence[float] | None = None, epochs: int | None = None,
                   boundaries: Sequence[int] | None = None, steps_per_epoch: int | None = None,
                   dtype: torch.dtype = torch.float32, tolerance: float = 0.01,
                   world_size: int | None = None) -> S:
    """A schedule (``make(base, by, values, **options)``) of a given *shape* that sends as many bytes
    over the run as ``base`` at the uniform value ``target``: with relative factors per size group
    and phase (``layer_factors=[10, 1]``: small layers get 10x the density of large ones),

        value(p, g) = c * phase_factors[p] * layer_factors[g]    (dense once past the parameter's range)

    with ``c`` found by bisection so that

        sum_p w_p * sum_l B(n_l, value(p, g(n_l)))  ==  sum_l B(n_l, target)

    ``B(n, v)``: the exact bytes a rank hands over for ``n`` elements at ``v``
    (:func:`grace_legacy.runtime.cost.bytes_sent`; with ``world_size``, counting what the dense
    fallback sends dense as dense); ``n_l``: the model's tensors (``sizes``: element counts or
    ``model.named_parameters()``); ``w_p``: phase ``p``'s share of the run. ``ValueError`` if no
    scale meets the budget within ``tolerance`` (relative)."""
    parameter = base.parameter
    if parameter is None or parameter.integer or parameter.high is None:
        raise ValueError(f"Legacy.budget_matched: needs a bounded continuous parameter whose bytes grow with it (a "
                         f"density); {type(base).__name__}'s parameter is "
                         f"{f'{parameter.name}, {parameter.describe_range()}' if parameter else 'missing'}")
    target = parameter.check(target, "Legacy.budget_matched(target)")
    numels = [int(s[1].numel()) if isinstance(s, tuple) else int(s) for s in sizes]
    if not numels:
        raise ValueError("Legacy.budget_matched: sizes is empty")
    layer_factors = list(layer_factors) if layer_factors is not None else [1.0] * (len(splits or []) + 1)
    phase_factors = list(phase_factors) if phase_factors is not None else [1.0]
    if by == "epoch":
        layer_factors = [1.0]
    if by == "layer":
        phase_factors = [1.0]
    for argument, factors in (("layer_factors", layer_factors), ("phase_factors", phase_factors)):
        if not factors or any(not isinstance(f, numbers.Real) or not f > 0 for f in factors):
            raise ValueError(f"Legacy.budget_matched: {argument} must be positive numbers, got {factors}")
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

    def run_bytes(schedule: S) -> float:
        return sum(weight * bytes_sent(schedule.configured_at(phase, schedule.group_of(n)), n, dtype, world_size)
                   for phase, weight in enumerate(schedule.phase_weights()) for n in numels)

    uniform = None if parameter.is_dense(target) else base.with_value(target)
    try:
        budget = sum(bytes_sent(uniform, n, dtype, world_size) for n in numels)
    except NotImplementedError as err:
        raise ValueError(f"Legacy.budget_matched: {type(base).__name__} cannot predict its bytes, so no budget "
                         f"can be matched ({err})") from None
    smallest = min(f * g for f in phase_factors for g in layer_factors)
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
