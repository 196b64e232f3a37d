"""How a reference case is written: a compression set-up, an identical *twin* driven by hand, and
the rule, written independently of grace_legacy, that combines every rank's decompressed payload.

A distributed worker trains the case's set-up through the optimizer
(``tests/distributed/zoo_worker.py`` under horovodrun), runs the twin on the same local gradient,
rank and seed, exchanges the twin's decompressed payloads with a plain allgather and combines them
by the rule; the optimizer's synchronized gradient must equal the result. The cases themselves are
registered in :mod:`tests.registry`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grace_legacy.communicators.fusion import step_flat_name


def mean_rule(decompressed: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(decompressed[0])
    for d in decompressed:
        total = total + d
    return total / len(decompressed)


def sum_rule(decompressed: list[torch.Tensor]) -> torch.Tensor:
    return mean_rule(decompressed) * len(decompressed)


def majority_vote_rule(decompressed: list[torch.Tensor]) -> torch.Tensor:
    """Sign of the sum of the ranks' signs; 0 where the vote ties."""
    votes = torch.zeros_like(decompressed[0])
    for d in decompressed:
        votes = votes + torch.sign(d)
    return torch.sign(votes)


#: Routes whose payloads the backend sums (in its own order and precision) rather than gathers.
SUMMED_ROUTES = ("dense", "dense-fallback", "allreduce")


def summed_in_16_bits(route: str, dtypes: list[torch.dtype]) -> bool:
    """Whether the backend sums this tensor in a 16-bit dtype (``dtypes``: the gradient's, then the
    payload's floating parts'): its result is then held to :func:`summed_bound`, not to a case's
    tolerances, since each backend sums in its own order."""
    return route in SUMMED_ROUTES and any(torch.finfo(d).bits <= 16 for d in dtypes)


def summed_bound(contributions: list[torch.Tensor], expected: torch.Tensor, dtypes: list[torch.dtype],
                 step: int, shifted) -> torch.Tensor:
    """How far, element by element, a sum the backend computes in a 16-bit dtype may lie from the
    rule's.

    Summing ``P`` values in any order, each addition rounding to a dtype with machine epsilon
    ``eps`` (``u = eps / 2``), lands within ``(P - 1) u sum_r |c_r|`` of the exact sum, and the mean
    within ``u ((P - 1) / P sum_r |c_r| + |mean|)`` of the exact mean: the backend's and the
    rule's (rank order) are each that close, so within ``eps (sum_r |c_r| + |mean|)`` of each
    other, plus the smallest subnormal where the result is too small for a relative bound. ``eps``
    is the coarsest of the model's dtype and the payload's. A memory's ``aggregated`` map carries the
    bound through ``shifted`` (the same map applied to the mean moved by it), plus one more
    rounding of the result; a memory that accumulates the means (EF21) adds one such bound per
    step, hence the factor ``step + 1``.
    """
    eps = max(torch.finfo(d).eps for d in dtypes)
    tiny = max(torch.finfo(d).smallest_normal * torch.finfo(d).eps for d in dtypes)
    magnitude = sum(c.double().abs() for c in contributions)
    mean = sum(c.double() for c in contributions) / len(contributions)
    on_mean = eps * (magnitude + mean.abs()) + tiny
    through = (shifted(mean + on_mean) - shifted(mean)).abs()
    return (step + 1) * (through + eps * expected.double().abs() + tiny)


def expected_and_bound(combined: torch.Tensor, memory, name: str, route: str, dtypes: list[torch.dtype],
                       contributions: list[torch.Tensor], step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient ``memory`` makes of the rule's ``combined`` (its ``aggregated`` map, which it
    advances), and, where the backend sums this tensor in 16 bits, the element-wise
    :func:`summed_bound` the result is held to in place of a case's tolerances (``None`` otherwise).
    ``dtypes``: the model's, then the payload's floating parts'."""
    probe = copy.deepcopy(memory) if summed_in_16_bits(route, dtypes) else None
    expected = memory.aggregated(name, combined)
    if probe is None:
        return expected, None
    return expected, summed_bound(contributions, expected, dtypes, step,
                                  lambda t: copy.deepcopy(probe).aggregated(name, t))


def beyond_bound(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> str | None:
    """Why ``got`` lies beyond ``expected`` +- ``bound`` (element-wise), or ``None`` if it does not."""
    excess = (got.double() - expected.double()).abs() - bound
    if bool((excess <= 0).all()):
        return None
    return f"beyond the rounding of a 16-bit sum by up to {excess.max().item():.3e}"


def mismatch(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | None, rtol: float,
             atol: float) -> str | None:
    """Why ``got`` differs from ``expected``: beyond ``bound`` where there is one (a 16-bit sum,
    :func:`expected_and_bound`), else beyond the tolerances; ``None`` if it does not."""
    if bound is not None:
        return beyond_bound(got, expected, bound)
    try:
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    except AssertionError as err:
        return str(err)[:600]
    return None


def step_units(local: dict[str, torch.Tensor], spans_step: bool) -> list[tuple[str, torch.Tensor, list[str]]]:
    """What a bundle compresses for one step of gradients ``local`` (name -> gradient): each
    gradient under its name, or, for a compressor that spans the step, the gradients of each dtype
    and device laid end to end in the order of their names, under the flat's name (the library
    names it, :func:`grace_legacy.communicators.fusion.step_flat_name`). ``(name, tensor, the
    gradients it holds)`` each."""
    if not spans_step:
        return [(name, grad, [name]) for name, grad in local.items()]
    groups: dict[str, list[str]] = {}
    for name in sorted(local):
        groups.setdefault(step_flat_name(local[name].dtype, local[name].device), []).append(name)
    return [(flat, torch.cat([local[n].reshape(-1) for n in names]), names) for flat, names in groups.items()]


def per_gradient(unit: tuple[str, torch.Tensor, list[str]], result: torch.Tensor,
                 local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``result`` of a :func:`step_units` unit cut back into its gradients' shapes."""
    _, _, names = unit
    pieces = torch.split(result.reshape(-1), [local[n].numel() for n in names])
    return {n: piece.view(local[n].shape) for n, piece in zip(names, pieces, strict=True)}


def twin_contributions(step_one: Callable[[torch.Tensor, str], tuple], local: dict[str, torch.Tensor],
                       spans_step: bool) -> dict[str, tuple]:
    """Per gradient name, in ``local``'s order, what ``step_one(tensor, name)`` returns for it (a
    tuple: the decompressed contribution, the bytes sent, then anything else), called once per
    :func:`step_units` unit; a flat's contribution is cut back into its gradients, its bytes
    counted with the first of them (0 with the others), its other fields given to each."""
    out: dict[str, tuple] = {}
    for unit in step_units(local, spans_step):
        contribution, sent, *rest = step_one(unit[1], unit[0])
        for i, (name, piece) in enumerate(per_gradient(unit, contribution, local).items()):
            out[name] = (piece, sent if i == 0 else 0, *rest)
    return {name: out[name] for name in local}


@dataclass
class Observation:
    step: int
    name: str
    #: every rank's decompressed contribution, in rank order
    contributions: list[torch.Tensor]
    route: str


@dataclass
class Case:
    label: str
    #: () -> (compression for the optimizer, twin compressor, twin memory)
    build: Callable[[], tuple[Any, Any, Any]]
    rule: Callable[[list[torch.Tensor]], torch.Tensor] = mean_rule
    rtol: float = 1e-6
    atol: float = 1e-7
    #: route names the case must have used at least once (e.g. {"allgather"})
    routes: set[str] = field(default_factory=set)
    #: the same when the model trains in float16 or bfloat16, where they differ (``None``: ``routes``):
    #: a 1-byte payload gathered from 4 ranks moves as many bytes as a ring allreduce of 2-byte
    #: gradients, so the dense fallback sends those tensors dense
    half_routes: set[str] | None = None
    #: after training: check(compression, observations) with one Observation per step and
    #: parameter; an AssertionError fails the case
    check: Callable[[Any, list[Observation]], None] | None = None


class RuleTwin:
    """A twin that picks the parameter from a rule written out in the test (not from ``Legacy``):
    ``choose(numel, step) -> value or None`` (None: dense). Copies made with ``with_value`` share
    the base's step counters and generators, as ``Legacy``'s do, so the draws line up."""

    def __init__(self, base, choose: Callable[[int, int], Any]) -> None:
        self.base, self.choose, self.step = base, choose, 0
        self.configured: dict[Any, Any] = {}

    def set_rank(self, rank: int) -> None:
        self.base.set_rank(rank)
        for c in self.configured.values():
            c.set_rank(rank)

    def compressor_for(self, tensor: torch.Tensor, name: str):
        value = self.choose(tensor.numel(), self.step)
        if value is None:
            return None
        if value not in self.configured:
            self.configured[value] = self.base.with_value(value)
        return self.configured[value].compressor_for(tensor, name)

    def end_step(self) -> None:
        self.step += 1


def first_group(numel: int, splits: list[int]) -> int:
    """The reference rule: the first i with numel < splits[i], else the last group."""
    return next((i for i, split in enumerate(splits) if numel < split), len(splits))


def equal_phase(epoch: float, epochs: int, phases: int) -> int:
    """The reference rule: the first i with epoch < (i + 1) * epochs / phases, else the last."""
    return next((i for i in range(phases) if epoch < (i + 1) * epochs / phases), phases - 1)


def some_payloads_empty(compression, observations: list[Observation]) -> None:
    """A Threshold payload is empty exactly when its decompressed tensor is all zeros (a kept entry
    has ``|v| >= threshold > 0``): some tensor must have been empty on some ranks only, and some
    on every rank."""
    empty = [[int(torch.count_nonzero(c)) == 0 for c in o.contributions] for o in observations]
    on_some = sum(any(e) and not all(e) for e in empty)
    on_all = sum(all(e) for e in empty)
    assert on_some and on_all, f"empty on some ranks only: {on_some} times, on all: {on_all}"
