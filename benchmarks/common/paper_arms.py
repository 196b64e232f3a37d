"""The two tables of the LEGACY authors' rebuttal, as arms of the accuracy benchmarks.

* QSGD, ResNet-9 on CIFAR-10, 30 epochs: uniform s=32; by epoch, thirds at s=64, 32, 16; by layer,
  tensors under 600 elements uncompressed, under 100k s=256, under 1M s=64, the rest s=16.
* PowerSGD, ResNet-18 on CIFAR-100, 200 epochs: uniform rank 3; L-GreCo; Accordion; by epoch,
  quarters at rank 6, 4, 3, 2; by layer, under 600 uncompressed, under 100k rank 8, under 1M rank 3,
  the rest rank 2.

Each table runs in two settings: the 8x8 digits with 2-D networks, and mnist1d with 1-D networks
of the same shape (:mod:`.resnets`). The networks are narrowed and the size splits mapped with
them, so every layer keeps its group. The digits keep the rebuttal's values, but there uniform
compression costs no accuracy (no headroom for a schedule to show); on mnist1d the uniform value is
chosen lower, where it does cost accuracy, and every value of the rebuttal's schedules (and of its
L-GreCo and Accordion) is scaled by the same factor, ``ours / rebuttal's uniform``, rounded to the
nearest integer and at least 1 (:func:`scale`).

The rebuttal does not say how it set up L-GreCo and Accordion: here L-GreCo picks a rank per tensor
among 1-8 (scaled) for no more error than the uniform rank, re-chosen every epoch, and Accordion
switches between rank 4 (critical regimes) and rank 2 (scaled), one either side of the uniform
rank, as the study's Accordion does around its density. PowerSGD runs with its error feedback in
every arm (as PowerSGD, L-GreCo and Accordion define it); QSGD, unbiased, without.

Uniform arms matched in bytes: for each fixed schedule, the uniform value whose expected link bytes
per step over the run (:func:`expected_volume`, from :func:`grace_legacy.runtime.cost.link_bytes`,
the route a default bundle takes and the dense fallback counted, over a dense ring allreduce's: the
wire volume ``TrafficStats`` measures) come closest to the schedule's is trained too. The
parameters are integers, so the match is the nearest, not exact; both volumes are measured and
reported.

A third mnist1d table is not the rebuttal's: Top-k with error feedback on the same ResNet-9, where
LEGACY's hand-set layer rule meets whole-model Top-k (:class:`~grace_legacy.GlobalTopK`), whose
layers' densities follow the gradients by themselves. Its arms, every one gathered
(``Allgather()``, as the LEGACY reference gathers): uniform Top-k at density ``d``; LEGACY by layer
with the rebuttal's QSGD layer rule as density factors (group S uncompressed, M ``8c``, L ``2c``,
H ``c / 2``: its levels ``-, 256, 64, 16`` over its uniform 32); whole-model Top-k at ratio ``g``.
``c`` and ``g`` are solved (:func:`solved`) so that each arm's expected link bytes equal the
uniform arm's, then rounded to three significant figures; the report gives each expected volume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

from grace_legacy import (
    QSGD,
    Accordion,
    Allgather,
    GlobalTopK,
    Grace,
    Legacy,
    LGreCo,
    NoMemory,
    PowerSGD,
    PowerSGDMemory,
    Residual,
    TopK,
)
from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.cost import choose_route, link_bytes, ring_allreduce_bytes, route_link_bytes
from grace_legacy.schedules.base import Schedule

from .arms import Arm, Run
from .resnets import PAPER_SPLITS, ResNet9, ResNet18, counterpart_splits, group_sizes, scaled_splits
from .tasks import Task

#: The rebuttal's values: uniform, by epoch, by layer (None: uncompressed), and its L-GreCo's and
#: Accordion's (ours: see the module's docstring).
QSGD_VALUES = {"uniform": 32, "epoch": [64, 32, 16], "layer": [None, 256, 64, 16]}
POWERSGD_VALUES = {"uniform": 3, "epoch": [6, 4, 3, 2], "layer": [None, 8, 3, 2], "lgreco": [1, 2, 3, 4, 6, 8],
                   "accordion": [4, 2]}
#: The Top-k table's layer rule: the rebuttal's QSGD levels by layer over its uniform (-, 256, 64,
#: 16 over 32), as factors of a density.
TOPK_LAYER_FACTORS = [None, 8, 2, 0.5]
#: The workers every table runs on (the benchmark's horovodrun -np).
WORKERS = 4


def scale(values: Sequence[int | None], factor: Fraction) -> list[int | None]:
    """Each value times ``factor``, rounded to the nearest integer (halves up) and at least 1;
    ``None`` (uncompressed) stays."""
    return [None if v is None else max(1, int(v * factor + Fraction(1, 2))) for v in values]


@dataclass(frozen=True)
class Setting:
    """Where a table runs: the data, the networks' dimensions and narrowing."""

    data: str                 # the tasks' data name
    described: str            # the data in words, for the report
    examples: str             # what one example is ("images", "signals")
    dims: int
    divisor: int

    def splits(self, build: Callable[[], nn.Module]) -> list[int]:
        """The rebuttal's size splits for this setting's version of ``build``'s network."""
        return scaled_splits(self.divisor) if self.dims == 2 else counterpart_splits(build())

    def describe_splits(self, splits: list[int]) -> str:
        if self.dims == 2:
            d = self.divisor
            return (f"splits {list(PAPER_SPLITS)} scaled to {splits}: widths / {d}, so weights shrink {d ** 2}x "
                    f"and 1-D tensors {d}x")
        return (f"splits {list(PAPER_SPLITS)} mapped to {splits}: each the smallest tensor whose full-size 2-D "
                "counterpart is in that group or above, so every layer is in its counterpart's group "
                "(`counterpart_splits`)")


DIGITS = Setting("digits", "the 8x8 digits", "images", dims=2, divisor=8)
MNIST1D = Setting("mnist1d", "mnist1d's 40-sample signals", "signals", dims=1, divisor=8)


@dataclass
class Table:
    """One rebuttal table in one setting: its network, task, compressor and arms, the paper's figures."""

    key: str
    title: str
    setup: str                                   # the rebuttal's setting, in words
    setting: Setting
    build: Callable[[], nn.Module]
    task: Task
    parameter: str                               # "s" or "r", for arm names
    paper_uniform: int                           # the rebuttal's uniform value
    reference: int                               # ours: the rebuttal's, or lower where that has no headroom
    candidates: list[int]                        # uniform values a schedule may be matched to
    uniform: Callable[[int, Run], Any]           # value -> compression
    schedules: list[Arm]                         # the rebuttal's arms besides uniform
    splits: list[int]
    #: arm -> (the rebuttal's name for it, its accuracy %, its volume %)
    paper: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    adaptive: tuple[str, ...] = ()               # arms whose bytes only a run can tell
    #: Uniform values trained as controls: as many wire bytes as the reference (see qsgd_table).
    controls: list[int] = field(default_factory=list)
    #: the route every compressed arm is pinned to ("allgather"), or None: each tensor's default
    route: str | None = None
    #: how the values were chosen, where they are not the rebuttal's (None: :func:`_scaling_line`'s)
    values_note: str | None = None
    #: pairs of arms whose paired difference the report gives (the question a table asks)
    comparisons: list[tuple[str, str]] = field(default_factory=list)

    @property
    def factor(self) -> Fraction:
        """What the rebuttal's values are multiplied by here."""
        return Fraction(self.reference, self.paper_uniform)

    def uniform_name(self, value: int) -> str:
        return f"uniform {self.parameter}={value}"

    @property
    def reference_name(self) -> str:
        return self.uniform_name(self.reference)

    def uniform_arm(self, value: int) -> Arm:
        return Arm(self.uniform_name(value), "uniform", False, lambda run: self.uniform(value, run))


def _qsgd(value: int | None, run: Run) -> Grace:
    return Grace(QSGD(value, seed=run.seed), memory=NoMemory())


def _qsgd_legacy(by: str, values: list, splits: list[int]) -> Callable[[Run], Grace]:
    def build(run: Run) -> Grace:
        shape = {"epochs": run.epochs} if by == "epoch" else {"splits": splits}
        return Grace(Legacy(QSGD(seed=run.seed), by=by, values=values, **shape), memory=NoMemory())
    return build


def _power(value: int, run: Run) -> Grace:
    return Grace(PowerSGD(value, seed=run.seed), memory=PowerSGDMemory())


def _power_legacy(by: str, values: list, splits: list[int]) -> Callable[[Run], Grace]:
    def build(run: Run) -> Grace:
        shape = {"epochs": run.epochs} if by == "epoch" else {"splits": splits}
        return Grace(Legacy(PowerSGD(seed=run.seed), by=by, values=values, **shape), memory=PowerSGDMemory())
    return build


def _lgreco(choices: list[int], reference: int) -> Callable[[Run], Grace]:
    def build(run: Run) -> Grace:
        return Grace(LGreCo(PowerSGD(seed=run.seed), choices, reference=reference, interval=run.steps_per_epoch),
                     memory=PowerSGDMemory())
    return build


def _accordion(low: int, high: int) -> Callable[[Run], Grace]:
    def build(run: Run) -> Grace:
        return Grace(Accordion(PowerSGD(seed=run.seed), low=low, high=high, interval=run.steps_per_epoch),
                     memory=PowerSGDMemory())
    return build


def _task(name: str, setting: Setting, splits: list[int], epochs: int, quick_epochs: int,
          batch_size: int = 64) -> Task:
    # SGD with momentum at 4 x 0.04, divided by 10 at half and three quarters of the run. Batches
    # of 64 a worker: on a shared 2-core machine a step's cost is mostly waiting for the 4 workers
    # to meet, so fewer, larger steps buy the most training for the time.
    return Task(name, "accuracy", epochs=epochs, batch_size=batch_size, lr=0.04, optimizer="sgd", split=splits[0],
                quick_epochs=quick_epochs, milestones=(0.5, 0.75), weight_decay=5e-4, data=setting.data)


def _names(values: Sequence[int | None]) -> str:
    return ",".join("-" if v is None else str(v) for v in values)


def qsgd_table(key: str, setting: Setting, reference: int, epochs: int, quick_epochs: int) -> Table:
    """The rebuttal's QSGD table on ResNet-9 in ``setting``, its values scaled to uniform ``s=reference``.

    QSGD's levels travel as int8 for every ``s`` up to 127, so the schedules' levels there cost the
    reference's wire bytes whatever they are, and so does a uniform arm at the schedules' highest
    level: it is trained as a control, to show what more levels alone buy at equal bytes."""
    def build() -> nn.Module:
        return ResNet9(divisor=setting.divisor, dims=setting.dims)

    splits = setting.splits(build)
    factor = Fraction(reference, QSGD_VALUES["uniform"])
    epoch, layer = scale(QSGD_VALUES["epoch"], factor), scale(QSGD_VALUES["layer"], factor)
    by_epoch, by_layer = f"LEGACY epoch s={_names(epoch)}", f"LEGACY layer s={_names(layer)}"
    candidates = sorted({max(1, reference // 2), reference, 2 * reference, *(v for v in layer if v)})
    return Table(
        key, f"QSGD, ResNet-9 (rebuttal: CIFAR-10; here: {setting.data})", "ResNet-9 on CIFAR-10, 2 workers, 30 epochs",
        setting, build, _task(f"resnet9-{setting.data}", setting, splits, epochs, quick_epochs), "s",
        QSGD_VALUES["uniform"], reference, candidates, _qsgd,
        [Arm(by_epoch, "legacy", False, _qsgd_legacy("epoch", epoch, splits)),
         Arm(by_layer, "legacy", False, _qsgd_legacy("layer", layer, splits))],
        splits, paper={f"uniform s={reference}": ("uniform s=32", 87.21, 18.76),
                       by_epoch: ("LEGACY epoch s=64,32,16", 87.97, 18.76),
                       by_layer: ("LEGACY layer s=-,256,64,16", 88.42, 16.4)},
        controls=[epoch[0]])


def powersgd_table(key: str, setting: Setting, reference: int, epochs: int, quick_epochs: int) -> Table:
    """The rebuttal's PowerSGD table on ResNet-18 in ``setting``, its values scaled to uniform
    rank ``reference``."""
    def build() -> nn.Module:
        return ResNet18(divisor=setting.divisor, dims=setting.dims)

    splits = setting.splits(build)
    factor = Fraction(reference, POWERSGD_VALUES["uniform"])
    epoch, layer = scale(POWERSGD_VALUES["epoch"], factor), scale(POWERSGD_VALUES["layer"], factor)
    choices = sorted(set(scale(POWERSGD_VALUES["lgreco"], factor)))
    low, high = scale(POWERSGD_VALUES["accordion"], factor)
    if low == high:
        raise ValueError(f"{key}: rank {reference} scales Accordion's ranks 4/2 to one rank ({low})")
    lgreco = f"L-GreCo r in {choices[0]}-{choices[-1]} (ref. {reference})"
    accordion = f"Accordion r={low}/{high}"
    by_epoch, by_layer = f"LEGACY epoch r={_names(epoch)}", f"LEGACY layer r={_names(layer)}"
    candidates = list(range(1, max(choices[-1], *(v for v in layer if v)) + 1))
    return Table(
        key, f"PowerSGD, ResNet-18 (rebuttal: CIFAR-100; here: {setting.data})",
        "ResNet-18 on CIFAR-100, 2 workers, 200 epochs",
        setting, build, _task(f"resnet18-{setting.data}", setting, splits, epochs, quick_epochs), "r",
        POWERSGD_VALUES["uniform"], reference, candidates, _power,
        [Arm(lgreco, "adaptive", True, _lgreco(choices, reference)),
         Arm(accordion, "adaptive", True, _accordion(low, high)),
         Arm(by_epoch, "legacy", True, _power_legacy("epoch", epoch, splits)),
         Arm(by_layer, "legacy", True, _power_legacy("layer", layer, splits))],
        splits,
        paper={f"uniform r={reference}": ("uniform r=3", 74.58, 1.06), lgreco: ("L-GreCo", 75.23, 0.93),
               accordion: ("Accordion", 75.11, 0.75), by_epoch: ("LEGACY epoch r=6,4,3,2", 75.55, 1.1),
               by_layer: ("LEGACY layer r=-,8,3,2", 75.21, 1.09)},
        adaptive=(lgreco, accordion))


def _topk(value: float, run: Run) -> Grace:
    return Grace(TopK(value), memory=Residual(), communicator=Allgather())


def _topk_layer(values: list, splits: list[int]) -> Callable[[Run], Grace]:
    def build(run: Run) -> Grace:
        return Grace(Legacy(TopK(), by="layer", values=values, splits=splits), memory=Residual(),
                     communicator=Allgather())
    return build


def _whole_model(ratio: float) -> Callable[[Run], Grace]:
    return lambda run: Grace(GlobalTopK(ratio), memory=Residual(), communicator=Allgather())


def solved(volume_of: Callable[[float], float], target: float, low: float, high: float) -> float:
    """The value in ``[low, high]`` whose volume (growing with it) is ``target``, by bisection, to
    three significant figures."""
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if volume_of(middle) < target else (low, middle)
    return float(f"{(low + high) / 2:.3g}")


def topk_table(key: str, setting: Setting, reference: float, epochs: int, quick_epochs: int) -> Table:
    """Top-k + EF on ResNet-9 in ``setting``, uniform at density ``reference``: LEGACY by layer and
    whole-model Top-k at its link bytes (see the module's docstring)."""
    def build() -> nn.Module:
        return ResNet9(divisor=setting.divisor, dims=setting.dims)

    splits, model = setting.splits(build), build()
    target = expected_volume(TopK(reference), model, 1, WORKERS, route="allgather")

    def layer_values(c: float) -> list[float | None]:
        return [None if f is None else min(1.0, f * c) for f in TOPK_LAYER_FACTORS]

    c = solved(lambda c: expected_volume(Legacy(TopK(), by="layer", values=layer_values(c), splits=splits), model,
                                         1, WORKERS, route="allgather"), target, 1e-6, 0.1)
    ratio = solved(lambda g: expected_volume(GlobalTopK(g), model, 1, WORKERS, route="allgather"), target, 1e-6, 1.0)
    by_layer = f"LEGACY layer d=-,{8 * c:.3g},{2 * c:.3g},{c / 2:.3g} + EF"
    whole = f"whole-model Top-k d={ratio:.3g} + EF"
    note = (f"Values: not the rebuttal's. Uniform Top-k + EF at d={reference}; LEGACY by layer with the rebuttal's "
            f"QSGD layer rule as density factors (-, 8c, 2c, c/2) and whole-model Top-k, c={c:.3g} and ratio "
            f"{ratio:.3g} solved for the uniform arm's expected link bytes, every arm gathered (Allgather()).")
    return Table(
        key, f"Top-k + EF, ResNet-9 (not in the rebuttal; here: {setting.data})",
        "not in the rebuttal: LEGACY's layer rule against whole-model Top-k, at equal link bytes",
        setting, build, _task(f"resnet9-{setting.data}", setting, splits, epochs, quick_epochs), "d",
        1, reference, [reference], _topk,
        [Arm(by_layer, "legacy", True, _topk_layer(layer_values(c), splits)),
         Arm(whole, "adaptive", True, _whole_model(ratio))],
        splits, route="allgather", values_note=note, comparisons=[(by_layer, whole)])


DENSE = Arm("dense", "dense", False, lambda run: hvd.Compression.none)



def expected_volume(compressor: Compressor, model: nn.Module, epochs: int, world_size: int,
                    route: str | None = None) -> float:
    """Link bytes a rank is expected to put on its link per step, averaged over the run's epochs,
    over a dense ring allreduce's (the wire volume): each tensor (the model's laid end to end, for a
    compressor that spans the step) on the route a default bundle takes for what the compressor
    resolves it to at that epoch (:func:`link_bytes`), or the one ``route`` forces, the dense
    fallback counted; a fixed schedule's bytes depend only on shapes and progress."""
    tensors = [(name, p.detach()) for name, p in model.named_parameters()]
    if compressor.traits.spans_step:
        tensors = [("whole", torch.cat([p.reshape(-1) for _, p in tensors]))]
    sent = dense = 0.0
    for epoch in range(epochs):
        if isinstance(compressor, Schedule):  # only a schedule's choices follow the epoch
            compressor.set_epoch(epoch)
        for name, p in tensors:
            concrete = compressor.compressor_for(p, name)
            if route is None or concrete is None:
                sent += link_bytes(concrete, p.shape, p.dtype, world_size)
            else:
                chosen = choose_route(concrete, p.shape, p.dtype, world_size, forced=route)
                sent += route_link_bytes(concrete, p.shape, p.dtype, world_size)[
                    "dense" if chosen == "dense" else chosen]
            dense += ring_allreduce_bytes(p.numel() * p.element_size(), world_size)
    return sent / dense


def matched_uniforms(table: Table, model: nn.Module, epochs: int, steps: int, world_size: int) -> dict[str, Any]:
    """For every fixed schedule of ``table``: its expected volume, and the candidate uniform value
    whose expected volume is nearest (ties to the table's reference value, then the smallest)."""
    def volume(arm_build: Callable[[Run], Grace]) -> float:
        run = Run(model, table.task, epochs, steps, world_size)
        return expected_volume(arm_build(run).compressor, model, epochs, world_size, route=table.route)

    uniform = {v: volume(lambda run, v=v: table.uniform(v, run)) for v in table.candidates}
    matches = {}
    for arm in table.schedules:
        if arm.name in table.adaptive:
            continue
        target = volume(arm.build)
        value = min(table.candidates, key=lambda v: (abs(uniform[v] - target), v != table.reference, v))
        matches[arm.name] = {"expected_volume": target, "uniform": value, "uniform_expected_volume": uniform[value]}
    return {"matches": matches, "uniform_expected": {str(v): x for v, x in uniform.items()}}


def table_arms(table: Table, matches: dict[str, Any]) -> list[Arm]:
    """Dense, the reference uniform, every matched uniform value and the controls, then the
    rebuttal's arms."""
    values = sorted({table.reference, *(m["uniform"] for m in matches["matches"].values()), *table.controls})
    return [DENSE, *(table.uniform_arm(v) for v in values), *table.schedules]


def group_table(table: Table, model: nn.Module) -> list[dict[str, Any]]:
    """Each size group's rebuttal split, this table's split, and the tensors and elements in it."""
    edges, scaled = [0, *PAPER_SPLITS, None], [0, *table.splits, None]
    return [{"group": "SMLH"[g], "paper": (edges[g], edges[g + 1]), "scaled": (scaled[g], scaled[g + 1]),
             "tensors": tensors, "elements": elements}
            for g, (tensors, elements) in enumerate(group_sizes(model, table.splits))]


TABLES = {
    "qsgd": qsgd_table("qsgd", DIGITS, 32, epochs=15, quick_epochs=3),
    "powersgd": powersgd_table("powersgd", DIGITS, 3, epochs=16, quick_epochs=4),
    "mnist1d-qsgd": qsgd_table("mnist1d-qsgd", MNIST1D, 2, epochs=12, quick_epochs=2),
    "mnist1d-powersgd": powersgd_table("mnist1d-powersgd", MNIST1D, 3, epochs=12, quick_epochs=2),
    "mnist1d-topk": topk_table("mnist1d-topk", MNIST1D, 0.005, epochs=12, quick_epochs=2),
}
