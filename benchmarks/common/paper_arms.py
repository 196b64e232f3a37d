"""The two tables of the LEGACY authors' rebuttal, as arms of the accuracy benchmarks.

* QSGD, ResNet-9 on CIFAR-10, 30 epochs: uniform s=32; by epoch, thirds at s=64, 32, 16; by layer,
  tensors under 600 elements uncompressed, under 100k s=256, under 1M s=64, the rest s=16.
* PowerSGD, ResNet-18 on CIFAR-100, 200 epochs: uniform rank 3; L-GreCo; Accordion; by epoch,
  quarters at rank 6, 4, 3, 2; by layer, under 600 uncompressed, under 100k rank 8, under 1M rank 3,
  the rest rank 2.

The schedules' values are the rebuttal's; the networks are narrowed (:mod:`.resnets`) and the size
splits scaled with them, so every layer keeps its group. The rebuttal does not say how it set up
L-GreCo and Accordion: here L-GreCo picks a rank per tensor among 1-8 for no more error than
uniform rank 3, re-chosen every epoch, and Accordion switches between rank 4 (critical regimes)
and rank 2, one either side of the uniform rank, as the study's Accordion does around its density.
PowerSGD runs with its error feedback in every arm (as PowerSGD, L-GreCo and Accordion define
it); QSGD, unbiased, without.

Uniform arms matched in bytes: for each fixed schedule, the uniform value whose expected bytes per
step over the run (:func:`expected_volume`, from :func:`grace_legacy.runtime.cost.bytes_sent`, the
dense fallback counted) come closest to the schedule's is trained too. The parameters are integers, so
the match is the nearest, not exact; both volumes are measured and reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
from torch import nn

from grace_legacy import QSGD, Accordion, Grace, Legacy, LGreCo, NoMemory, PowerSGD, PowerSGDMemory
from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.cost import bytes_sent

from .arms import Arm, Run
from .resnets import PAPER_SPLITS, WIDTH_DIVISOR, ResNet9, ResNet18, group_sizes, scaled_splits
from .tasks import Task

SPLITS = scaled_splits(WIDTH_DIVISOR)


@dataclass
class Table:
    """One rebuttal table: its network, task, compressor and arms, and the paper's figures."""

    key: str
    title: str
    setup: str                                   # the rebuttal's setting, in words
    build: Callable[[], nn.Module]
    task: Task
    parameter: str                                    # "s" or "r", for arm names
    paper_uniform: int
    candidates: list[int]                        # uniform values a schedule may be matched to
    uniform: Callable[[int, Run], Any]           # value -> compression
    schedules: list[Arm]                         # the rebuttal's arms besides uniform
    paper: dict[str, tuple[float, float]] = field(default_factory=dict)  # arm -> (accuracy %, volume %)
    adaptive: tuple[str, ...] = ()               # arms whose bytes only a run can tell

    def uniform_name(self, value: int) -> str:
        return f"uniform {self.parameter}={value}"

    def uniform_arm(self, value: int) -> Arm:
        return Arm(self.uniform_name(value), "uniform", False, lambda run: self.uniform(value, run))


def _qsgd(value: int | None, run: Run) -> Grace:
    return Grace(QSGD(value, seed=run.seed), memory=NoMemory())


def _qsgd_legacy(by: str, values: list) -> Callable[[Run], Grace]:
    def build(run: Run) -> Grace:
        shape = {"epochs": run.epochs} if by == "epoch" else {"splits": SPLITS}
        return Grace(Legacy(QSGD(seed=run.seed), by=by, values=values, **shape), memory=NoMemory())
    return build


def _power(value: int, run: Run) -> Grace:
    return Grace(PowerSGD(value, seed=run.seed), memory=PowerSGDMemory())


def _power_legacy(by: str, values: list) -> Callable[[Run], Grace]:
    def build(run: Run) -> Grace:
        shape = {"epochs": run.epochs} if by == "epoch" else {"splits": SPLITS}
        return Grace(Legacy(PowerSGD(seed=run.seed), by=by, values=values, **shape), memory=PowerSGDMemory())
    return build


def _lgreco(run: Run) -> Grace:
    return Grace(LGreCo(PowerSGD(seed=run.seed), [1, 2, 3, 4, 6, 8], reference=3, interval=run.steps_per_epoch),
                 memory=PowerSGDMemory())


def _accordion(run: Run) -> Grace:
    return Grace(Accordion(PowerSGD(seed=run.seed), low=4, high=2, interval=run.steps_per_epoch),
                 memory=PowerSGDMemory())


def _task(name: str, epochs: int, quick_epochs: int) -> Task:
    # Both networks: SGD with momentum at 4 x 0.04, divided by 10 at half and three quarters of the run.
    # Batches of 64 a worker (5 steps an epoch): on a shared 2-core machine a step's cost is mostly
    # waiting for the 4 workers to meet, so fewer, larger steps buy the most training for the time.
    return Task(name, "accuracy", epochs=epochs, batch_size=64, lr=0.04, optimizer="sgd", split=SPLITS[0],
                quick_epochs=quick_epochs, milestones=(0.5, 0.75), weight_decay=5e-4, data="digits")


DENSE = Arm("dense", "dense", False, lambda run: hvd.Compression.none)

TABLES = {
    "qsgd": Table(
        "qsgd", "QSGD, ResNet-9 (rebuttal: CIFAR-10; here: digits)",
        "ResNet-9 on CIFAR-10, 2 workers, 30 epochs",
        ResNet9, _task("resnet9", epochs=15, quick_epochs=3), "s", 32, [16, 32, 64, 256], _qsgd,
        [Arm("LEGACY epoch s=64,32,16", "legacy", False, _qsgd_legacy("epoch", [64, 32, 16])),
         Arm("LEGACY layer s=-,256,64,16", "legacy", False, _qsgd_legacy("layer", [None, 256, 64, 16]))],
        paper={"uniform s=32": (87.21, 18.76), "LEGACY epoch s=64,32,16": (87.97, 18.76),
               "LEGACY layer s=-,256,64,16": (88.42, 16.4)}),
    "powersgd": Table(
        "powersgd", "PowerSGD, ResNet-18 (rebuttal: CIFAR-100; here: digits)",
        "ResNet-18 on CIFAR-100, 2 workers, 200 epochs",
        ResNet18, _task("resnet18", epochs=16, quick_epochs=4), "r", 3, list(range(1, 9)), _power,
        [Arm("L-GreCo r in 1-8 (ref. 3)", "adaptive", True, _lgreco),
         Arm("Accordion r=4/2", "adaptive", True, _accordion),
         Arm("LEGACY epoch r=6,4,3,2", "legacy", True, _power_legacy("epoch", [6, 4, 3, 2])),
         Arm("LEGACY layer r=-,8,3,2", "legacy", True, _power_legacy("layer", [None, 8, 3, 2]))],
        paper={"uniform r=3": (74.58, 1.06), "L-GreCo r in 1-8 (ref. 3)": (75.23, 0.93),
               "Accordion r=4/2": (75.11, 0.75), "LEGACY epoch r=6,4,3,2": (75.55, 1.1),
               "LEGACY layer r=-,8,3,2": (75.21, 1.09)},
        adaptive=("L-GreCo r in 1-8 (ref. 3)", "Accordion r=4/2")),
}


def expected_volume(compressor: Compressor, model: nn.Module, epochs: int, world_size: int) -> float:
    """Bytes a rank is expected to hand over per step, averaged over the run's epochs, over a dense
    send's: each tensor on the route the compressor resolves it to at that epoch, the dense
    fallback counted (a fixed schedule's bytes depend only on shapes and progress)."""
    sent = dense = 0
    for epoch in range(epochs):
        compressor.set_epoch(epoch)
        for name, p in model.named_parameters():
            concrete = compressor.compressor_for(p.detach(), name)
            sent += bytes_sent(concrete, p.shape, p.dtype, world_size)
            dense += p.numel() * p.element_size()
    return sent / dense


def matched_uniforms(table: Table, model: nn.Module, epochs: int, steps: int, world_size: int) -> dict[str, Any]:
    """For every fixed schedule of ``table``: its expected volume, and the candidate uniform value
    whose expected volume is nearest (ties to the rebuttal's uniform value)."""
    def volume(arm_build: Callable[[Run], Grace]) -> float:
        run = Run(model, table.task, epochs, steps, world_size)
        return expected_volume(arm_build(run).compressor, model, epochs, world_size)

    uniform = {v: volume(lambda run, v=v: table.uniform(v, run)) for v in table.candidates}
    matches = {}
    for arm in table.schedules:
        if arm.name in table.adaptive:
            continue
        target = volume(arm.build)
        value = min(table.candidates, key=lambda v: (abs(uniform[v] - target), v != table.paper_uniform, v))
        matches[arm.name] = {"expected_volume": target, "uniform": value, "uniform_expected_volume": uniform[value]}
    return {"matches": matches, "uniform_expected": {str(v): x for v, x in uniform.items()}}


def table_arms(table: Table, matches: dict[str, Any]) -> list[Arm]:
    """Dense, the rebuttal's uniform and every matched uniform value, then the rebuttal's arms."""
    values = sorted({table.paper_uniform, *(m["uniform"] for m in matches["matches"].values())})
    return [DENSE, *(table.uniform_arm(v) for v in values), *table.schedules]


def group_table(model: nn.Module) -> list[dict[str, Any]]:
    """Each size group's rebuttal split, scaled split, and the tensors and elements in it."""
    edges, scaled = [0, *PAPER_SPLITS, None], [0, *SPLITS, None]
    return [{"group": "SMLH"[g], "paper": (edges[g], edges[g + 1]), "scaled": (scaled[g], scaled[g + 1]),
             "tensors": tensors, "elements": elements}
            for g, (tensors, elements) in enumerate(group_sizes(model, SPLITS))]


def describe_splits() -> str:
    return (f"splits {list(PAPER_SPLITS)} scaled to {SPLITS}: widths / {WIDTH_DIVISOR}, so weights shrink "
            f"{WIDTH_DIVISOR ** 2}x and 1-D tensors {WIDTH_DIVISOR}x")

