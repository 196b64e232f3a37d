"""The time-to-accuracy benchmark's workers (:mod:`benchmarks.accuracy.time_to_accuracy`): one
launch runs one framework at one worker count and link rate, in the namespaces of
:class:`~benchmarks.common.netns.Cluster`. It first times every arm's step side by side (the
arms interleaved burst by burst, with a compute-only way: :func:`time_steps`), then trains the
launch's (arm, seed) runs one after another (:func:`train_run`), each to its step budget,
evaluating on the held-out set every ``eval_every`` steps. Rank 0 appends each record to the
results JSON (:func:`append_result`) as it finishes, so a launch stopped at any point keeps what it
finished and a later one skips it.

The clock of a run counts the training steps only: at each evaluation the ranks stop, rank 0
evaluates, and every rank meets at a barrier before the clock runs again. So the time to a target
is what the user waits for training, without the evaluations this benchmark adds.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common.limited_link import COMPUTE, interleave, timed_on_link
from benchmarks.common.link_counters import read_link
from benchmarks.common.time_to_accuracy_arms import (
    ARMS,
    HOROVOD,
    LR,
    MOMENTUM,
    ONE_BUCKET_MB,
    Arm,
    Setting,
    wide_mlp,
)


def run_key(framework: str, workers: int, rate: float, arm: str, seed: int) -> str:
    """A run's key in the results."""
    return f"{framework}/{workers}/{rate!r}/{arm}/{seed}"


def timing_key(framework: str, workers: int, rate: float) -> str:
    """A launch's step timing's key in the results."""
    return f"timing/{framework}/{workers}/{rate!r}"


# -- the results file --------------------------------------------------------------------------------

def load_results(path: Path) -> dict[str, Any]:
    """The results so far: ``{"setup": ..., "runs": [...], "timings": [...], "parts": [...]}``, and
    ``"superseded"``: records measured again with newer code (kept, never reported)."""
    return json.loads(path.read_text()) if path.exists() else {"setup": None, "runs": [], "timings": [],
                                                               "parts": []}


def append_result(path: Path, kind: str, record: dict[str, Any]) -> None:
    """Add ``record`` to the list ``kind`` of the results file, in place of one with the same key
    (a launch's step timing made again for more arms); written under another name and then
    renamed, so that a launch stopped while writing leaves the previous file whole."""
    results = load_results(path)
    results[kind] = [r for r in results[kind] if r["key"] != record["key"]] + [record]
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(results, indent=1))
    temporary.replace(path)


# -- the collectives the harness itself needs -----------------------------------------------------------

class Ranks:
    """The process group's rank and size, a barrier and a max over the ranks, through Horovod or
    ``torch.distributed``. Horovod's are waited for asleep, as grace_legacy waits for its own: a
    rank spinning in Horovod's wait would take CPU time from ranks still computing."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self._calls = 0
        if framework == HOROVOD:
            import horovod.torch as hvd

            import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer takes grace_legacy compression)

            hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()
        else:
            from datetime import timedelta

            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=timedelta(seconds=900))
            self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def max(self, values: list[float]) -> list[float]:
        """``values``, each the largest over the ranks (one float64 allreduce)."""
        tensor = torch.tensor(values, dtype=torch.float64)
        self._calls += 1
        if self.framework == HOROVOD:
            import horovod.torch as hvd

            from grace_legacy.backends.horovod import synchronize

            return synchronize(hvd.allreduce_async(tensor, name=f"tta.max.{self._calls}", op=hvd.Max)).tolist()
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def barrier(self) -> None:
        self.max([0.0])

    def root_says(self, flag: bool) -> bool:
        """Rank 0's ``flag``, on every rank (a decision only rank 0 can take, kept by all)."""
        return self.max([float(flag) if self.rank == 0 else 0.0])[0] > 0

    def tiny_collective_s(self, repeats: int = 10) -> float:
        """The median over ``repeats`` of the slowest rank's time for an allreduce of 8 bytes, all
        ranks starting at once: what a collective costs beyond its bytes on these links."""
        times = []
        for _ in range(repeats):
            self.barrier()
            start = time.perf_counter()
            self.barrier()
            times.append(self.max([time.perf_counter() - start])[0])
        return statistics.median(times)


# -- one arm, built --------------------------------------------------------------------------------------

@dataclass
class Trainer:
    """An arm's model, its optimizer (Horovod's wraps SGD; DDP's is SGD on the wrapped model) and
    the compression state that keeps statistics (a ``Grace`` bundle or ``GraceState``), if any."""

    arm: Arm | None
    model: nn.Module
    forward: nn.Module
    optimizer: Any
    state: Any = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step; returns when its backward pass ended."""
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self.forward(x), y).backward()
        backward_done = time.perf_counter()
        self.optimizer.step()
        return backward_done

    def stats(self) -> dict[str, Any]:
        """The bundle's volume and routes (nothing for Horovod's and PyTorch's own compression)."""
        stats = getattr(self.state, "stats", None)
        if not isinstance(stats, dict):
            return {}
        return {"volume": stats.get("volume"), "routes": stats.get("tensors_by_route", {})}


def build_trainer(arm: Arm | None, ranks: Ranks, seed: int, widths: tuple[int, ...], prefix: str) -> Trainer:
    """``arm`` (``None``: compute only, no communication) on a fresh model from ``seed``: every arm
    of a seed starts from the same weights. ``prefix`` names its tensors for Horovod, so that the
    collectives of arms alive at once are never taken for one another."""
    torch.manual_seed(seed)
    model = wide_mlp(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if arm is None:
        return Trainer(None, model, model, optimizer)
    setting = Setting(model, ranks.size, LR)
    if arm.framework == HOROVOD:
        import horovod.torch as hvd

        from benchmarks.common.training import broadcast_parameters

        compression = arm.compression(setting)
        named = [(f"{prefix}.{name}", p) for name, p in model.named_parameters()]
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
        broadcast_parameters(model.state_dict())
        # The bundle that runs it (a bare compressor's too); None for Horovod's own compression.
        return Trainer(arm, model, model, optimizer, getattr(optimizer, "grace", None))
    from torch.nn.parallel import DistributedDataParallel

    import grace_legacy.ddp

    ddp = DistributedDataParallel(model, bucket_cap_mb=ONE_BUCKET_MB if arm.one_bucket else None)
    state = None
    if arm.torch_hook is not None:
        state = arm.torch_hook(setting)(ddp)
    elif arm.compression is not None:
        state = grace_legacy.ddp.register(ddp, arm.compression(setting))
    return Trainer(arm, model, ddp, optimizer, state)


# -- the data ----------------------------------------------------------------------------------------------

@dataclass
class Data:
    """This rank's share of the training set (every ``size``-th sample from ``rank``), the held-out
    set, and the per-worker batch of a global batch of ``global_batch``."""

    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    batch: int
    steps_per_epoch: int

    @classmethod
    def load(cls, ranks: Ranks, global_batch: int, quick: bool) -> Data:
        from benchmarks.common.tasks import TASKS, load

        _, (x, y), (x_test, y_test) = load(TASKS["mnist1d"], quick)
        batch = global_batch // ranks.size
        return cls(x[ranks.rank::ranks.size], y[ranks.rank::ranks.size], x_test, y_test, batch,
                   len(y) // ranks.size // batch)

    def batches(self, seed: int, rank: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The next batch, epoch after epoch, in an order drawn from ``seed`` and ``rank``: every
        arm of a seed sees the same batches."""
        generator = torch.Generator().manual_seed(1000 * seed + rank)
        order: list[torch.Tensor] = []

        def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
            if not order:
                permutation = torch.randperm(len(self.y), generator=generator)
                order.extend(permutation[i * self.batch:(i + 1) * self.batch] for i in range(self.steps_per_epoch))
            chosen = order.pop(0)
            return self.x[chosen], self.y[chosen]
        return next_batch

    def accuracy(self, model: nn.Module) -> float:
        with torch.no_grad():
            return (model(self.x_test).argmax(1) == self.y_test).float().mean().item()


# -- the step timing ---------------------------------------------------------------------------------------

def time_steps(arms: list[Arm], ranks: Ranks, data: Data, widths: tuple[int, ...], warmup: int,
               bursts: int, burst: int) -> dict[str, Any]:
    """Every arm's step and a compute-only step, interleaved by bursts (the order rotated every
    iteration): ``warmup`` untimed bursts then ``bursts`` timed ones per arm, each ``burst``
    consecutive steps started together after a barrier, as steps follow one another in training
    (a rank that is done early goes on with the next step). Per burst: the slowest rank's time and
    the bytes of its busiest link (the larger of sent and received, from the interface counters,
    headers included), each divided by ``burst``: per step."""
    trainers = {COMPUTE: build_trainer(None, ranks, 0, widths, COMPUTE)}
    trainers.update({arm.name: build_trainer(arm, ranks, 0, widths, f"timing.{arm.name}") for arm in arms})
    next_batch = data.batches(0, ranks.rank)
    batch = next_batch()

    def steps(name: str) -> float:
        for _ in range(burst):
            trainers[name].step(*batch)
        return time.perf_counter()

    def timed(name: str) -> dict[str, float]:
        ranks.barrier()
        elapsed, _, link = timed_on_link(lambda: steps(name))
        top = ranks.max([elapsed, float(link)])
        return {"step_s": top[0] / burst, "link_bytes": top[1] / burst}

    measured = interleave({name: (warmup, bursts) for name in trainers}, timed)
    return {"ways": measured, "burst": burst, "tiny_collective_s": ranks.tiny_collective_s(),
            "routes": {name: t.stats().get("routes", {}) for name, t in trainers.items()}}


# -- one run -----------------------------------------------------------------------------------------------

def train_run(arm: Arm, seed: int, ranks: Ranks, data: Data, widths: tuple[int, ...], budget_steps: int,
              eval_every: int, cap_s: float) -> dict[str, Any]:
    """Train ``arm`` from ``seed`` for ``budget_steps`` (or until its clock passes ``cap_s``),
    evaluating every ``eval_every`` steps; the run's record (``curve``: ``[step, clock s,
    accuracy]`` rows, the first at step 0; ``stopped_by``: ``"budget"`` or ``"time cap"``)."""
    load_before = os.getloadavg()[0]
    trainer = build_trainer(arm, ranks, seed, widths, f"run.{arm.name}.{seed}")
    next_batch = data.batches(seed, ranks.rank)
    curve = [[0, 0.0, data.accuracy(trainer.model)]] if ranks.rank == 0 else []
    ranks.barrier()  # every rank starts the clock together, after rank 0's evaluation
    clock, sent, received, step, stopped_by = 0.0, 0, 0, 0, "budget"
    before = read_link()
    for step in range(1, budget_steps + 1):
        x, y = next_batch()
        start = time.perf_counter()
        trainer.step(x, y)
        clock += time.perf_counter() - start
        if step % eval_every and step != budget_steps:
            continue
        after = read_link()
        sent, received = sent + after.tx - before.tx, received + after.rx - before.rx
        if ranks.rank == 0:
            curve.append([step, clock, data.accuracy(trainer.model)])
        if ranks.root_says(clock > cap_s) and step < budget_steps:
            stopped_by = "time cap"
            break
        before = read_link()
    busiest = ranks.max([float(max(sent, received))])[0]
    return {"arm": arm.name, "framework": arm.framework, "seed": seed, "workers": ranks.size, "curve": curve,
            "steps": step, "budget_steps": budget_steps, "stopped_by": stopped_by, "train_s": clock,
            "link_bytes_per_step": busiest / step, "steps_per_epoch": data.steps_per_epoch,
            **trainer.stats(), "load_average": [load_before, os.getloadavg()[0]]}


# -- a launch ----------------------------------------------------------------------------------------------

def estimated_s(results: dict[str, Any], key: str, arm: str, budget_steps: int) -> float | None:
    """How long a run of ``arm`` should take from this launch's timing (``key``): its median step
    times the budget, plus a tenth for the evaluations and building; ``None`` if not timed."""
    timing = next((t for t in results["timings"] if t["key"] == key), None)
    if timing is None or arm not in timing["ways"]:
        return None
    return 1.1 * budget_steps * statistics.median(timing["ways"][arm]["step_s"])


def run_launch(spec: dict[str, Any]) -> None:
    """A launch, as the driver describes it in ``spec``: the framework, the rate (for the records),
    whether to time the steps first, the (arm, seed) runs in order, the deadline (seconds since the
    epoch) after which no run is started, and the results file."""
    ranks = Ranks(spec["framework"])
    torch.set_num_threads(1)
    setup = spec["setup"]
    widths, results = tuple(setup["widths"]), Path(spec["results"])
    data = Data.load(ranks, setup["global_batch"], setup["quick"])
    rate, framework = spec["rate"], spec["framework"]
    key = timing_key(framework, ranks.size, rate)
    if spec["timing"]:
        arms = [ARMS[name] for name in spec["arms"]]
        load_before = os.getloadavg()[0]
        timing = time_steps(arms, ranks, data, widths, setup["timing_warmup"], setup["timing_bursts"],
                            setup["timing_burst"])
        if ranks.rank == 0:
            append_result(results, "timings", {"key": key, "framework": framework, "workers": ranks.size,
                                               "rate": rate, "code": spec.get("code"), **timing,
                                               "load_average": [load_before, os.getloadavg()[0]]})
    budget = max(1, round(setup["epochs"] * data.steps_per_epoch))
    eval_every = max(1, round(setup["eval_epochs"] * data.steps_per_epoch))
    for arm_name, seed in spec["runs"]:
        expected = estimated_s(load_results(results), key, arm_name, budget) if ranks.rank == 0 else None
        if not ranks.root_says(expected is None or time.time() + expected < spec["deadline"]):
            break
        record = train_run(ARMS[arm_name], seed, ranks, data, widths, budget, eval_every, setup["run_cap_s"])
        if ranks.rank == 0:
            record.update(key=run_key(framework, ranks.size, rate, arm_name, seed), rate=rate, code=spec.get("code"))
            append_result(results, "runs", record)
            print(f"[{framework} {ranks.size}w {rate:g}] {arm_name} seed {seed}: {record['steps']} steps, "
                  f"{record['train_s']:.1f} s, accuracy {record['curve'][-1][2]:.4f}", flush=True)
