"""The study's arms: how each one compresses, built for a given model and run length.

The sparsifying arms share one uniform target density; every LEGACY arm is budget-matched to it
with :meth:`grace_legacy.Legacy.budget_matched` (same expected bytes over the run, the dense
fallback counted), so arms are compared at equal data volume. The measured volume of every run
is reported next to its accuracy, so the match can be checked rather than assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
from torch import nn

from grace_legacy import QSGD, Grace, Legacy, NoMemory, Residual, TopK

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


@dataclass
class Arm:
    name: str
    family: str                                  # groups arms in plots: dense, uniform, legacy, ...
    error_feedback: bool
    build: Callable[[Run], Any]                  # -> the `compression` for hvd.DistributedOptimizer


def _memory(error_feedback: bool):
    return Residual() if error_feedback else NoMemory()


def _legacy(by: str, error_feedback: bool) -> Callable[[Run], Any]:
    def build(run: Run) -> Grace:
        shape: dict[str, Any] = {}
        if by in ("layer", "both"):
            shape.update(splits=[run.task.split], layer_factors=LAYER_FACTORS)
        if by in ("epoch", "both"):
            shape.update(phase_factors=PHASE_FACTORS, epochs=run.epochs)
        schedule = Legacy.budget_matched(TopK(), DENSITY, by=by, sizes=run.model.named_parameters(),
                                         steps_per_epoch=run.steps_per_epoch, world_size=run.world_size, **shape)
        return Grace(schedule, memory=_memory(error_feedback))
    return build


def _qsgd_legacy(run: Run) -> Grace:
    # Levels up to 127 all travel as int8, so this schedule sends exactly the uniform arm's bytes
    # while giving small tensors finer levels (the rebuttal's shape: finer where tensors are small).
    return Grace(Legacy(QSGD(seed=1), by="layer", values=[64, 2], splits=[run.task.split]))


ARMS = [
    Arm("dense", "dense", False, lambda run: hvd.Compression.none),
    Arm("uniform Top-k", "uniform", False, lambda run: Grace(TopK(DENSITY), memory=NoMemory())),
    Arm("uniform Top-k + EF", "uniform", True, lambda run: Grace(TopK(DENSITY), memory=Residual())),
    Arm("LEGACY epoch", "legacy", False, _legacy("epoch", False)),
    Arm("LEGACY epoch + EF", "legacy", True, _legacy("epoch", True)),
    Arm("LEGACY layer", "legacy", False, _legacy("layer", False)),
    Arm("LEGACY layer + EF", "legacy", True, _legacy("layer", True)),
    Arm("LEGACY both", "legacy", False, _legacy("both", False)),
    Arm("LEGACY both + EF", "legacy", True, _legacy("both", True)),
    Arm("uniform QSGD s=2", "qsgd", False, lambda run: Grace(QSGD(2, seed=1))),
    Arm("LEGACY QSGD layer", "qsgd", False, _qsgd_legacy),
]

QUICK_ARMS = ["dense", "uniform Top-k + EF", "LEGACY both + EF", "LEGACY QSGD layer"]
