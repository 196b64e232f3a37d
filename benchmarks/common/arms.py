"""The study's arms: how each one compresses, built for a given model and run length.

The sparsifying arms share one uniform target density; every LEGACY arm is budget-matched to it
with :meth:`grace_legacy.Legacy.budget_matched` (same expected bytes over the run, the dense
fallback counted), so arms are compared at equal data volume. The measured volume of every run
is reported next to its accuracy, so the match can be checked rather than assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from grace_legacy import QSGD, Accordion, DGCWarmup, Grace, Legacy, LGreCo, NoMemory, Residual, TopK
from grace_legacy.runtime.cost import bytes_sent

from .tasks import Task

DENSITY = 0.01                 # the uniform Top-k arm's density
LAYER_FACTORS = [10, 1]        # small tensors get 10x the density of large ones
PHASE_FACTORS = [2, 1, 0.5]    # the first third of training 2x, the last 0.5x


@dataclass
class Run:
    """What an arm needs to know about the run it is built for."""

    model: nn.Module
    task: Task
    epochs: int
    steps_per_epoch: int
    world_size: int
    seed: int = 0


@dataclass
class Arm:
    name: str
    family: str                                  # groups arms in plots: dense, uniform, legacy, ...
    error_feedback: bool
    build: Callable[[Run], Any]                  # -> the `compression` for hvd.DistributedOptimizer


def _memory(error_feedback: bool):
    return Residual() if error_feedback else NoMemory()


def legacy_topk(by: str, error_feedback: bool, phase_factors: Sequence[float] = tuple(PHASE_FACTORS),
                first_phase: float | None = None) -> Callable[[Run], Any]:
    """A LEGACY Top-k arm budget-matched to the uniform density: small tensors (under the task's
    split) get ``LAYER_FACTORS``, phases ``phase_factors``; equal phases, or with ``first_phase``
    two phases, the first that fraction of the run (at least one epoch)."""
    def build(run: Run) -> Grace:
        shape: dict[str, Any] = {}
        if by in ("layer", "both"):
            shape.update(splits=[run.task.split], layer_factors=LAYER_FACTORS)
        if by in ("epoch", "both"):
            shape.update(phase_factors=list(phase_factors), epochs=run.epochs)
            if first_phase is not None:
                shape.update(boundaries=[max(1, round(first_phase * run.epochs))])
        schedule = Legacy.budget_matched(TopK(), DENSITY, by=by, sizes=run.model.named_parameters(),
                                         steps_per_epoch=run.steps_per_epoch, world_size=run.world_size, **shape)
        return Grace(schedule, memory=_memory(error_feedback))
    return build


def _qsgd_legacy(run: Run) -> Grace:
    # Levels up to 127 all travel as int8, so this schedule sends exactly the uniform arm's bytes
    # while giving small tensors finer levels (the rebuttal's shape: finer where tensors are small).
    return Grace(Legacy(QSGD(seed=1), by="layer", values=[64, 2], splits=[run.task.split]))


def _dgc_warmup(run: Run) -> Grace:
    """DGC's warm-up, its target density solved so the run's expected bytes equal the uniform
    arm's. DGC warms over 4 of 90+ epochs; these runs are 4-12 epochs, so the warm-up takes one
    (two or more cannot be matched: their dense-ish first epochs alone exceed the budget)."""
    numels = [p.numel() for p in run.model.parameters()]

    def run_bytes(schedule: DGCWarmup | None, density: float) -> float:
        parameters = [schedule.value_at(e) for e in range(run.epochs)] if schedule else [density]
        return sum(bytes_sent(TopK(parameter), n, torch.float32, run.world_size)
                   for parameter in parameters for n in numels) / len(parameters)

    budget = run_bytes(None, DENSITY)
    low, high = DENSITY / 100, DENSITY
    for _ in range(60):  # bisection on the target: the run's bytes grow with it
        target = (low + high) / 2
        schedule = DGCWarmup(TopK(), target=target, warmup_epochs=1, steps_per_epoch=run.steps_per_epoch)
        low, high = (target, high) if run_bytes(schedule, 0) < budget else (low, target)
    if abs(run_bytes(schedule, 0) - budget) > 0.01 * budget:
        raise ValueError(f"DGC warm-up: no target matches the uniform budget over {run.epochs} epochs")
    return Grace(schedule, memory=Residual())


def _accordion(run: Run) -> Grace:
    # The paper's pairing: light compression 2x the uniform density in critical regimes, heavy
    # 0.5x otherwise, decided once an epoch. Its volume follows the regimes, so it is measured.
    return Grace(Accordion(TopK(), low=2 * DENSITY, high=DENSITY / 2, interval=run.steps_per_epoch),
                 memory=Residual())


def _lgreco(run: Run) -> Grace:
    # Per-tensor densities from 4x to 0.25x the uniform one, re-chosen every epoch for no more
    # error than the uniform density: at most the uniform volume, measured.
    choices = [4 * DENSITY, 2 * DENSITY, DENSITY, DENSITY / 2, DENSITY / 4]
    return Grace(LGreCo(TopK(), choices, reference=DENSITY, interval=run.steps_per_epoch), memory=Residual())


ARMS = [
    Arm("dense", "dense", False, lambda run: hvd.Compression.none),
    Arm("uniform Top-k", "uniform", False, lambda run: Grace(TopK(DENSITY), memory=NoMemory())),
    Arm("uniform Top-k + EF", "uniform", True, lambda run: Grace(TopK(DENSITY), memory=Residual())),
    Arm("LEGACY epoch", "legacy", False, legacy_topk("epoch", False)),
    Arm("LEGACY epoch + EF", "legacy", True, legacy_topk("epoch", True)),
    Arm("LEGACY layer", "legacy", False, legacy_topk("layer", False)),
    Arm("LEGACY layer + EF", "legacy", True, legacy_topk("layer", True)),
    Arm("LEGACY both", "legacy", False, legacy_topk("both", False)),
    Arm("LEGACY both + EF", "legacy", True, legacy_topk("both", True)),
    Arm("uniform QSGD s=2", "qsgd", False, lambda run: Grace(QSGD(2, seed=1))),
    Arm("LEGACY QSGD layer", "qsgd", False, _qsgd_legacy),
    Arm("DGC warm-up + EF", "adaptive", True, _dgc_warmup),
    Arm("Accordion + EF", "adaptive", True, _accordion),
    Arm("L-GreCo + EF", "adaptive", True, _lgreco),
]

QUICK_ARMS = ["dense", "uniform Top-k + EF", "LEGACY both + EF", "LEGACY QSGD layer", "DGC warm-up + EF",
              "Accordion + EF", "L-GreCo + EF"]
