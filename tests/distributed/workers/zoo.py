"""Cases for the generic compressor worker (``zoo_worker.py``).

A case builds two identical compression set-ups: one run by ``hvd.DistributedOptimizer`` and a
*twin* (compressor + memory) that the worker drives by hand on the same local gradient, rank and
seed. The twin's decompressed payloads are exchanged with a plain allgather and combined by the
case's rule, written independently here; the optimizer's synchronized gradient must equal it.

Each compressor family registers its cases in its own ``zoo_cases_<family>.py`` module, as a
module-level ``CASES`` list.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: The families of cases, one ``zoo_cases_<family>.py`` module each.
FAMILIES = sorted(p.stem.removeprefix("zoo_cases_") for p in Path(__file__).parent.glob("zoo_cases_*.py"))


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
    #: after training: check(compression, observations) with one Observation per step and
    #: parameter; an AssertionError fails the case
    check: Callable[[Any, list[Observation]], None] | None = None


@dataclass
class Observation:
    step: int
    name: str
    #: every rank's decompressed contribution, in rank order
    contributions: list[torch.Tensor]
    route: str


class RuleTwin:
    """A twin that picks the knob from a rule written out in the test (not from ``Legacy``):
    ``choose(numel, step) -> value or None`` (None: dense). Copies made with ``with_knob`` share
    the base's step counters and generators, as ``Legacy``'s do, so the draws line up."""

    def __init__(self, base, choose: Callable[[int, int], Any]) -> None:
        self.base, self.choose, self.step = base, choose, 0
        self.configured: dict[Any, Any] = {}

    def set_rank(self, rank: int) -> None:
        self.base.set_rank(rank)
        for c in self.configured.values():
            c.set_rank(rank)

    def resolve(self, tensor: torch.Tensor, name: str):
        value = self.choose(tensor.numel(), self.step)
        if value is None:
            return None
        if value not in self.configured:
            self.configured[value] = self.base.with_knob(value)
        return self.configured[value].resolve(tensor, name)

    def end_step(self) -> None:
        self.step += 1


def first_group(numel: int, splits: list[int]) -> int:
    """The reference rule: the first i with numel < splits[i], else the last group."""
    return next((i for i, split in enumerate(splits) if numel < split), len(splits))


def equal_phase(epoch: float, epochs: int, phases: int) -> int:
    """The reference rule: the first i with epoch < (i + 1) * epochs / phases, else the last."""
    return next((i for i in range(phases) if epoch < (i + 1) * epochs / phases), phases - 1)


def cases(family: str | None = None) -> list[Case]:
    """The registered cases of one family (one of :data:`FAMILIES`), or of all of them."""
    return [case for name in ([family] if family else FAMILIES)
            for case in importlib.import_module(f"zoo_cases_{name}").CASES]
