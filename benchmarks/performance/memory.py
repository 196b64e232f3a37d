"""Memory over a long run: the library's own structures, Python allocations and RSS, step by step.

    python -m benchmarks.performance.memory            # the full run: 2,000 steps (a few minutes here)
    python -m benchmarks.performance.memory --quick    # a smoke run (seconds)

Every compressor family, memory and schedule runs 2,000 optimizer steps of a small model's
gradients (three tensors) in one process, through a ``Grace`` bundle with fused buckets, on a
one-rank backend that keeps nothing. At steps 0, 500, 1000 and 2000 (and every 100 for the plot)
it records:

* **entries**: the container entries (dict items, list and deque items) and **tensor bytes**
  reachable from the bundle through grace_legacy objects, counted by :func:`structure_size`:
  residuals, momenta, warm starts, step counters, stats, schedule histories, fusion plans;
* **objects**: the live Python objects the garbage collector tracks (the whole process);
* **traced**: the bytes Python allocated from grace_legacy's own source lines and still holds
  (``tracemalloc``, the difference from step 0);
* **RSS**: the process's resident memory (it includes PyTorch's allocator, so it is the noisiest).

Then one real run: ``horovodrun -np 2 --gloo`` trains a small MLP for 2,000 steps with
``hvd.DistributedOptimizer`` and LEGACY-scheduled Top-k with error feedback, recording the same
numbers on every rank. Results go to ``benchmarks/results/memory.md`` and
``benchmarks/results/memory.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
#: A small model's gradients: a matrix large enough for every compressor to compress, a bias, a head.
SHAPES = {"fc1.weight": (32, 64), "fc1.bias": (64,), "fc2.weight": (64, 10)}
TABLE_STEPS = (0, 500, 1000, 2000)
QUICK_STEPS = (0, 5, 10, 20)
#: Only allocations made on these files' lines count as "traced" (the library's own memory).
TRACED_FILES = ("*grace_legacy*", "*tests/helpers.py")


# -- measuring --------------------------------------------------------------------------------


def _own(obj: Any) -> bool:
    """Whether ``obj``'s attributes are the library's (or its test backends') own state."""
    module = type(obj).__module__ or ""
    return module.startswith("grace_legacy") or module in ("tests.helpers", __name__)


def structure_size(*roots: Any) -> tuple[int, int]:
    """``(entries, tensor_bytes)`` reachable from ``roots``: every item of a dict, list, tuple,
    set or deque counts as one entry, every tensor its ``numel * element_size`` bytes. Objects of
    grace_legacy's classes are followed through their attributes; anything else is a leaf. Each
    object is counted once, however many paths lead to it (configured copies share state)."""
    seen: set[int] = set()
    stack = list(roots)
    entries = tensor_bytes = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensor_bytes += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            entries += len(obj)
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            entries += len(obj)
            stack.extend(obj)
        elif _own(obj):
            state = dict(getattr(obj, "__dict__", {}))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    state[slot] = getattr(obj, slot)
            stack.extend(state.values())
    return entries, tensor_bytes


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def traced_bytes() -> int:
    """Bytes currently held by allocations made on the library's own source lines."""
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, p) for p in TRACED_FILES])
    return sum(stat.size for stat in snapshot.statistics("filename"))


# -- one rank, in process ---------------------------------------------------------------------


class SoloBackend:
    """A one-rank backend: every collective returns its input, and nothing is kept."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> torch.Tensor:
        return tensor.clone()

    def allgather_async(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.clone()

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
        return tensor.clone()

    def alltoall_async(self, tensor: torch.Tensor, splits: list[int], name: str) -> torch.Tensor:
        return tensor.clone()

    def wait(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


def cases() -> dict[str, Callable[[], Any]]:
    """Every compressor, memory and schedule, as a ``Grace`` bundle factory. Schedules go through
    all their phases within the first 200 steps, so a later step adds no new route or label."""
    from grace_legacy import (
        DGC,
        EF21,
        FP16,
        QSGD,
        Accordion,
        DGCWarmup,
        EFSignSGD,
        Grace,
        Legacy,
        LGreCo,
        Natural,
        NoCompression,
        OneBit,
        PowerSGD,
        RandomK,
        SignSGD,
        Signum,
        TernGrad,
        Threshold,
        TopK,
    )

    return {
        "NoCompression": lambda: Grace(NoCompression()),
        "FP16": lambda: Grace(FP16()),
        "TopK + Residual": lambda: Grace(TopK(0.1)),
        "RandomK + EF21": lambda: Grace(RandomK(0.1, seed=1), memory=EF21()),
        "DGC + DGCMemory": lambda: Grace(DGC(0.1, min_samples=16)),
        "Threshold + Residual": lambda: Grace(Threshold(1.0)),
        "QSGD": lambda: Grace(QSGD(16)),
        "TernGrad": lambda: Grace(TernGrad()),
        "Natural": lambda: Grace(Natural()),
        "SignSGD": lambda: Grace(SignSGD()),
        "Signum": lambda: Grace(Signum(0.9)),
        "EFSignSGD": lambda: Grace(EFSignSGD(lr=0.1)),
        "OneBit + Residual": lambda: Grace(OneBit()),
        "PowerSGD + PowerSGDMemory": lambda: Grace(PowerSGD(2)),
        "Legacy(TopK, both)": lambda: Grace(Legacy(TopK(), by="both", values=[[1.0, 0.1], [0.1, 0.01], [None, 0.05]],
                                                   splits=[100], epochs=6, steps_per_epoch=20)),
        "DGCWarmup(DGC)": lambda: Grace(DGCWarmup(DGC(min_samples=16), target=0.01, warmup_epochs=4,
                                                  steps_per_epoch=20)),
        # history=20 rather than the default 100, so that the bound is reached well before step 500.
        "Accordion(TopK), history=20": lambda: Grace(Accordion(TopK(), low=0.2, high=0.02, interval=5, history=20)),
        "LGreCo(PowerSGD), history=20": lambda: Grace(LGreCo(PowerSGD(), [1, 2, 4, None], reference=2, interval=20,
                                                             history=20)),
    }


def gradient_pool(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Four sets of gradients of different scales, so that adaptive schedules see their norms change."""
    generator = torch.Generator().manual_seed(seed)
    return [{name: torch.randn(shape, generator=generator) * scale for name, shape in shapes.items()}
            for scale in (1.0, 3.0, 0.5, 8.0)]


class Run:
    """Steps one bundle the way ``hvd.DistributedOptimizer`` does: start every tensor, wait for
    them all, flag non-finite gradients, end the step (commit, schedule progress)."""

    def __init__(self, bundle: Any, backend: Any, shapes: dict[str, tuple[int, ...]] = SHAPES, seed: int = 0) -> None:
        self.bundle, self.backend = bundle, backend
        self.names = sorted(shapes)
        self.pool = gradient_pool(shapes, seed)
        self.steps = 0
        bundle.plan_buckets([(n, 4 * torch.Size(shapes[n]).numel()) for n in reversed(self.names)])

    def step(self) -> None:
        gradients = self.pool[(self.steps // 7) % len(self.pool)]
        pending = [self.bundle.start(gradients[n], n, self.backend, True) for n in self.names]
        for p in pending:
            p()
        self.bundle.guard.nonfinite_names(self.names, self.backend)
        self.bundle.end_step(self.backend)
        compressor = self.bundle.compressor
        if hasattr(compressor, "set_lr") and self.steps % 20 == 10:
            compressor.set_lr(1.0 / (1 + self.steps))  # a learning-rate drop every 20 steps
        self.steps += 1

    def advance(self, to: int) -> None:
        while self.steps < to:
            self.step()


def measure(run: Run, traced_from: int | None) -> dict[str, int]:
    gc.collect()
    entries, tensor_bytes = structure_size(run.bundle)
    out = {"step": run.steps, "entries": entries, "tensor_bytes": tensor_bytes, "objects": len(gc.get_objects()),
           "rss": rss_bytes()}
    if traced_from is not None:
        out["traced"] = traced_bytes() - traced_from
    return out


def in_process(checkpoints: Iterable[int]) -> dict[str, list[dict[str, int]]]:
    checkpoints = sorted(set(checkpoints))
    results = {}
    for label, build in cases().items():
        tracemalloc.start()
        try:
            run = Run(build(), SoloBackend())
            baseline = traced_bytes()
            rows = []
            for step in checkpoints:
                run.advance(step)
                rows.append(measure(run, baseline))
        finally:
            tracemalloc.stop()
        results[label] = rows
        print(f"{label}: {rows[-1]}", flush=True)
    return results


# -- the real run under horovodrun ------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    from benchmarks.common.training import broadcast_parameters
    from grace_legacy import Grace, Legacy, Residual, TopK

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    compression = Grace(Legacy(TopK(), by="both", values=[[1.0, 0.1], [1.0, 0.01]], splits=[1000], epochs=2,
                               steps_per_epoch=max(1, args.checkpoints[-1] // 20)), memory=Residual())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(), compression=compression)
    broadcast_parameters(model.state_dict())
    generator = torch.Generator().manual_seed(hvd.rank())
    inputs, labels = torch.randn(256, 64, generator=generator), torch.randint(0, 10, (256,), generator=generator)
    checkpoints = sorted(set(args.checkpoints))
    tracemalloc.start()
    baseline = traced_bytes()
    rows = []
    started = time.perf_counter()
    for step in range(checkpoints[-1] + 1):
        if step in checkpoints:
            gc.collect()
            entries, tensor_bytes = structure_size(compression)
            rows.append({"step": step, "entries": entries, "tensor_bytes": tensor_bytes,
                         "objects": len(gc.get_objects()), "rss": rss_bytes(), "traced": traced_bytes() - baseline})
        if step == checkpoints[-1]:
            break
        batch = slice((step * 32) % 256, (step * 32) % 256 + 32)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs[batch]), labels[batch]).backward()
        optimizer.step()
    elapsed = time.perf_counter() - started
    per_rank = hvd.allgather_object({"rank": hvd.rank(), "rows": rows, "seconds": elapsed})
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps({"ranks": per_rank, "compression": repr(compression)}))


def under_horovod(checkpoints: Iterable[int]) -> dict[str, Any]:
    from benchmarks.common.report import run_workers

    return run_workers("benchmarks.performance.memory", 2, "--checkpoints", *map(str, checkpoints))


# -- the report -------------------------------------------------------------------------------


def _growth(rows: list[dict[str, int]], key: str, since: int) -> int:
    """How much ``key`` changed from step ``since`` to the last step recorded."""
    by_step = {r["step"]: r[key] for r in rows}
    return rows[-1][key] - by_step[since]


def write(result: dict[str, Any], results_dir: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common.report import update_section

    table_steps = result["table_steps"]

    def at(rows: list[dict[str, int]], key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        by_step = {r["step"]: r[key] for r in rows}
        return " / ".join(fmt.format(by_step[s] / scale) for s in table_steps)

    lines = []
    for label, rows in result["in_process"].items():
        lines.append(f"| {label} | {at(rows, 'entries')} | {at(rows, 'tensor_bytes', 1024, '{:.1f}')} | "
                     f"{at(rows, 'objects')} | {at(rows, 'traced', 1024, '{:.1f}')} | "
                     f"{at(rows, 'rss', 2**20, '{:.1f}')} |")
    horovod = result.get("horovod")
    horovod_text = ""
    if horovod:
        hlines = "\n".join(f"| rank {r['rank']} | {at(r['rows'], 'entries')} | "
                           f"{at(r['rows'], 'tensor_bytes', 1024, '{:.1f}')} | {at(r['rows'], 'objects')} | "
                           f"{at(r['rows'], 'traced', 1024, '{:.1f}')} | {at(r['rows'], 'rss', 2**20, '{:.1f}')} |"
                           for r in horovod["ranks"])
        horovod_text = f"""
### Under `horovodrun -np 2 --gloo`

A 64-128-10 MLP trained with `hvd.DistributedOptimizer` and `{horovod['compression']}` for
{table_steps[-1]:,} steps ({horovod['ranks'][0]['seconds']:.0f} s on rank 0); the same numbers, on each rank.

| rank | entries | tensor KiB | Python objects | traced KiB | RSS MiB |
|---|---|---|---|---|---|
{hlines}
"""
    steady = [label for label, rows in result["in_process"].items()
              if _growth(rows, "entries", table_steps[1]) == 0 and _growth(rows, "tensor_bytes", table_steps[1]) == 0]
    worst_traced = max((_growth(rows, "traced", table_steps[1]) for rows in result["in_process"].values()), default=0)
    objects_growth = max((_growth(rows, "objects", table_steps[1]) for rows in result["in_process"].values()),
                         default=0)
    steps_text = " / ".join(map(str, table_steps))
    text = f"""## Memory over {table_steps[-1]:,} steps

`{command}`

Machine: {result['machine']}. Each cell reads "at step {steps_text}". **entries**: container
entries (dict, list, deque items) reachable from the bundle through grace_legacy objects;
**tensor KiB**: the bytes of the tensors among them (residuals, momenta, warm starts,
accumulated gradients); **Python objects**: live objects tracked by the garbage collector (the
whole process); **traced KiB**: Python memory allocated on grace_legacy's own lines and
still held, against step 0 (`tracemalloc`); **RSS MiB**: the whole process (one process runs
every case in turn, so RSS includes the cases before it).

In process: gradients of {len(SHAPES)} tensors ({', '.join(f'{n} {list(s)}' for n, s in SHAPES.items())}),
a `Grace` bundle with fused buckets on a one-rank backend, stepped as `hvd.DistributedOptimizer`
steps it.

| case | entries | tensor KiB | Python objects | traced KiB | RSS MiB |
|---|---|---|---|---|---|
{chr(10).join(lines)}

From step {table_steps[1]} to {table_steps[-1]}: structures of constant size in {len(steady)} of
{len(result['in_process'])} cases (changed: {', '.join(sorted(set(result['in_process']) - set(steady))) or 'none'});
live Python objects grew by at most {objects_growth}; traced memory by at most
{worst_traced / 1024:.1f} KiB, while the number of live objects stays the same: that growth is
made of 66-byte blocks allocated inside PyTorch by `torch.tensor(<Python numbers>)` calls on
those lines, a few bytes per step; a bare loop of such calls, with no grace_legacy code at all,
retains memory at a similar rate, so it is not a structure the library keeps.
{horovod_text}
![memory over steps](memory.png)
"""
    update_section(results_dir / "memory.md", "memory", text, title="Memory results")

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for label, rows in result["in_process"].items():
        steps = [r["step"] for r in rows]
        left.plot(steps, [r["entries"] for r in rows], label=label)
        right.plot(steps, [r["traced"] / 1024 for r in rows], label=label)
    if horovod:
        for r in horovod["ranks"]:
            steps = [row["step"] for row in r["rows"]]
            left.plot(steps, [row["entries"] for row in r["rows"]], "k--", label=f"horovodrun rank {r['rank']}")
            right.plot(steps, [row["traced"] / 1024 for row in r["rows"]], "k--")
    left.set(xlabel="step", ylabel="container entries", title="grace_legacy structures", yscale="log")
    right.set(xlabel="step", ylabel="KiB (vs step 0)", title="Python memory held by grace_legacy (tracemalloc)")
    left.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    results_dir.mkdir(parents=True, exist_ok=True)
    figure.savefig(results_dir / "memory.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run (20 steps)")
    parser.add_argument("--no-horovod", action="store_true", help="skip the horovodrun -np 2 run")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoints", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.common.report import machine

    table_steps = QUICK_STEPS if args.quick else TABLE_STEPS
    # A measurement (a collection, a heap snapshot) takes far longer than a step: a smoke run
    # measures at the table's steps alone, a full run 20 times along the way for the figure.
    checkpoints = sorted({*table_steps, *([] if args.quick else range(0, table_steps[-1] + 1, table_steps[-1] // 20))})
    result: dict[str, Any] = {"table_steps": list(table_steps), "machine": machine(),
                              "in_process": in_process(checkpoints)}
    if not args.no_horovod:
        result["horovod"] = under_horovod(checkpoints)
    command = "python -m benchmarks.performance.memory" + (" --quick" if args.quick else "")
    write(result, args.results, command)


if __name__ == "__main__":
    main()
