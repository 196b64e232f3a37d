"""What the many-workers study trains (``benchmarks/accuracy/many_workers.py``): its arms, and one
run of an arm as ``W`` simulated workers (:class:`grace_legacy.simulate.Simulation`).

The global batch is fixed and split among the workers, so the number of workers changes only who
computes which gradient, never the data of a step: step ``t`` of epoch ``e`` takes samples
``t B .. (t + 1) B - 1`` of a permutation drawn from ``(seed, e)``, worker ``w`` the ``w``-th
``B / W`` of them. A dense run is then the same at any ``W`` up to the order of float additions,
and the runs of one seed pair across worker counts as well as across arms (same initial weights,
same batches): what changes with ``W`` is only what compression does with ``W`` gradients.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grace_legacy import (
    QSGD,
    Allgather,
    EFSignSGD,
    Grace,
    Legacy,
    NoCompression,
    NoMemory,
    Residual,
    ScatterGather,
    TopK,
)
from grace_legacy.core.seeds import derived_seed
from grace_legacy.simulate import Simulation

#: The uniform Top-k density: the LEGACY abstract's "Top-0.1%".
DENSITY = 0.001
#: QSGD's levels: aggressive (the rebuttal's s=32 scaled as paper_tables does on mnist1d).
QSGD_LEVELS = 2
LAYER_FACTORS = [10, 1]        # small tensors 10x the density of large ones (as benchmarks/common/arms.py)
PHASE_FACTORS = [2, 1, 0.5]    # the first third of the run 2x, the last 0.5x


@dataclass(frozen=True)
class Setting:
    """The training run every arm shares: a global batch split among the workers, SGD with momentum
    and a step decay of the rate at ``milestones`` of the run."""

    global_batch: int = 256
    epochs: int = 12
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    milestones: tuple[float, ...] = (0.5, 0.75)
    decay: float = 10.0
    split: int = 5_000           # LEGACY's small/large split (tensors under it are "small")

    def lr_at(self, epoch: int) -> float:
        return self.lr / self.decay ** sum(epoch >= m * self.epochs for m in self.milestones)


@dataclass(frozen=True)
class Arm:
    name: str
    family: str            # dense, uniform, legacy, qsgd, signs
    route: str             # what the report says about the route
    build: Callable[[nn.Module, Setting, int, int], Grace]   # (model, setting, workers, steps per epoch)


def _legacy(by: str) -> Callable[[nn.Module, Setting, int, int], Grace]:
    """LEGACY Top-k budget-matched to uniform Top-0.1% in link bytes at ``workers`` (the route a
    default bundle takes: a gather, or dense where that is cheaper)."""
    def build(model: nn.Module, setting: Setting, workers: int, steps: int) -> Grace:
        shape: dict[str, Any] = {}
        if by == "layer":
            shape.update(splits=[setting.split], layer_factors=LAYER_FACTORS)
        else:
            shape.update(phase_factors=PHASE_FACTORS, epochs=setting.epochs)
        schedule = Legacy.budget_matched(TopK(), DENSITY, by=by, sizes=model.named_parameters(),
                                         world_size=workers, **shape)
        return Grace(schedule, memory=Residual())
    return build


def _forced(make: Callable[[Setting], Any], communicator: Callable[[], Any]) -> Callable[..., Grace]:
    """Every tensor on one route (no dense fallback), as benchmarks/accuracy/scatter_gather.py."""
    return lambda model, setting, workers, steps: Grace(make(setting), communicator=communicator(),
                                                        dense_fallback=False)


def _efsignsgd(setting: Setting) -> EFSignSGD:
    return EFSignSGD(lr=setting.lr)   # its memory keeps the error in parameter units at the initial rate


ARMS = [
    Arm("dense", "dense", "allreduce", lambda model, setting, workers, steps: Grace(NoCompression(), NoMemory())),
    Arm("uniform Top-0.1% + EF", "uniform", "default",
        lambda model, setting, workers, steps: Grace(TopK(DENSITY), memory=Residual())),
    Arm("LEGACY layer + EF", "legacy", "default", _legacy("layer")),
    Arm("LEGACY epoch + EF", "legacy", "default", _legacy("epoch")),
    Arm("QSGD s=2 gathered", "qsgd", "allgather", _forced(lambda s: QSGD(QSGD_LEVELS, seed=1), Allgather)),
    Arm("QSGD s=2 two-phase", "qsgd", "scattergather", _forced(lambda s: QSGD(QSGD_LEVELS, seed=1), ScatterGather)),
    Arm("EF-signSGD gathered", "signs", "allgather", _forced(_efsignsgd, Allgather)),
    Arm("EF-signSGD two-phase", "signs", "scattergather", _forced(_efsignsgd, ScatterGather)),
    Arm("EF-signSGD two-phase, no owner feedback", "signs", "scattergather",
        _forced(_efsignsgd, lambda: ScatterGather(owner_feedback=False))),
    Arm("Top-0.1% + EF two-phase", "uniform", "scattergather", _forced(lambda s: TopK(DENSITY), ScatterGather)),
    Arm("Top-0.1% + EF two-phase, no owner feedback", "uniform", "scattergather",
        _forced(lambda s: TopK(DENSITY), lambda: ScatterGather(owner_feedback=False))),
]
ARM = {arm.name: arm for arm in ARMS}


def _generator(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*key) % 2**63)


def train_simulated(arm: Arm, workers: int, seed: int, setting: Setting, build: Callable[[], nn.Module], train,
                    test, evaluate: Callable[[nn.Module, Any], float], epochs: int | None = None) -> dict[str, Any]:
    """``arm`` trained by ``workers`` simulated workers from seed ``seed``: the run's record."""
    epochs = setting.epochs if epochs is None else epochs
    x_all, y_all = train
    batch = setting.global_batch // workers
    if batch * workers != setting.global_batch:
        raise ValueError(f"{workers} workers do not divide the global batch of {setting.global_batch}")
    steps = len(y_all) // setting.global_batch
    torch.manual_seed(seed)
    model = build()
    template = arm.build(model, setting, workers, steps)
    started = time.perf_counter()
    with Simulation(model, lambda worker: copy.deepcopy(template), workers) as sim:
        optimizer = torch.optim.SGD(model.parameters(), lr=setting.lr, momentum=setting.momentum,
                                    weight_decay=setting.weight_decay)
        curve = []
        for epoch in range(epochs):
            sim.set_epoch(epoch)
            for group in optimizer.param_groups:
                group["lr"] = setting.lr_at(epoch)
            order = torch.randperm(len(y_all), generator=_generator("batches", seed, epoch))
            for step in range(steps):
                chosen = order[step * setting.global_batch:(step + 1) * setting.global_batch]
                sim.backward([(x_all[part], y_all[part]) for part in chosen.view(workers, batch)])
                optimizer.step()
            curve.append(evaluate(model, test))
        stats = sim.stats
        memory = sim.memory()
        vectorized = sim.gradients.vectorized
    return {"arm": arm.name, "family": arm.family, "route": arm.route, "workers": workers, "seed": seed,
            "final": curve[-1], "curve": curve, "epochs": epochs, "steps_per_epoch": steps,
            "volume": sum(s["volume"] for s in stats) / len(stats), "routes": dict(stats[0]["tensors_by_route"]),
            "memory": memory, "vectorized": vectorized, "wall_s": time.perf_counter() - started}
