"""LEGACY's overhead: training-step time with ``Legacy(TopK(), ...)`` against ``TopK`` at the same
density, through the real ``hvd.DistributedOptimizer`` path.

    python -m benchmarks.performance.legacy_overhead            # the full run (about 4 minutes here)
    python -m benchmarks.performance.legacy_overhead --quick    # a smoke run (seconds)

Two Horovod workers (``horovodrun -np 2 --gloo``) train two identical copies of a ResNet-like CNN
(74 parameter tensors) on synthetic 32x32 images, each copy behind its own
``hvd.DistributedOptimizer``: one with ``Grace(TopK(0.01), Residual())``, the other with
``Grace(Legacy(TopK(), by="both", ...), Residual())`` whose table holds 0.01 in every phase and
size group, so both send exactly the same bytes (checked) and any difference is LEGACY's own cost
(its table lookup per tensor per step, progress bookkeeping). The arms alternate step by step, in
ABBA order, so that drift on a shared machine hits both alike; each step's time is the slowest
rank's. Reported: median and quartiles per arm, the ratio of medians, and the median of the
paired ratios (each LEGACY step over its neighbouring TopK step). A micro-measurement of
``resolve`` alone (the lookup LEGACY adds) is reported next to it, as nanoseconds per tensor and
as a share of the median step. Results go to ``benchmarks/results/performance.md`` (section
"legacy_overhead") and ``legacy_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DENSITY = 0.01
TARGET = 0.01  # LEGACY should add under 1% to the step time


def resnet_like(width: int = 32, blocks: int = 10):
    """Conv/BatchNorm residual blocks: 2 + 7 * blocks + 2 parameter tensors (74 for 10 blocks)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(), nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width))

        def forward(self, x):
            return nn.functional.relu(x + self.body(x))

    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         *[Block() for _ in range(blocks)], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, 10))


def legacy_schedule():
    from grace_legacy import Legacy, TopK

    # Same density everywhere, but a real two-phase, two-group table: every lookup is made.
    return Legacy(TopK(), by="both", values=[[DENSITY, DENSITY], [DENSITY, DENSITY]], splits=[5_000], epochs=2)


def resolve_cost(arms: dict, model, repetitions: int = 200) -> dict[str, float]:
    """Nanoseconds per tensor of ``resolve`` (what the bundle asks the compressor every step)."""
    params = [(n, p) for n, p in model.named_parameters()]
    costs = {}
    for arm, compressor in arms.items():
        best = float("inf")
        for _ in range(repetitions):
            start = time.perf_counter_ns()
            for name, p in params:
                compressor.compressor_for(p, name)
            best = min(best, (time.perf_counter_ns() - start) / len(params))
        costs[arm] = best
    return costs


def worker(args: argparse.Namespace) -> None:
    import copy

    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (routes grace_legacy compression through hvd.DistributedOptimizer)
    from benchmarks.common.step_models import slowest_horovod_step
    from grace_legacy import Grace, Residual, TopK

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = resnet_like(blocks=2 if args.quick else 10)
    compressors = {"TopK": TopK(DENSITY), "Legacy(TopK)": legacy_schedule()}
    arms = {}
    for arm, compressor in compressors.items():
        model = copy.deepcopy(base)
        bundle = Grace(compressor, Residual())
        named = [(f"{arm}.{n}", p) for n, p in model.named_parameters()]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=named,
                                       compression=bundle)
        arms[arm] = (model, opt, bundle)
    data = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(args.batch_size, 3, 32, 32, generator=data)
    y = torch.randint(0, 10, (args.batch_size,), generator=data)

    def step(arm: str) -> float:
        model, opt, _ = arms[arm]
        return slowest_horovod_step(model, opt, x, y)

    for _ in range(args.warmup):
        for arm in arms:
            step(arm)
    for _, _, bundle in arms.values():
        bundle.reset_stats()
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    order = list(arms)
    for i in range(args.steps):
        for arm in (order if i % 2 == 0 else order[::-1]):  # ABBA: drift cancels in the pairs
            times[arm].append(step(arm))
    if hvd.rank() == 0:
        a, b = times["TopK"], times["Legacy(TopK)"]
        paired = [lb / la for la, lb in zip(a, b, strict=True)]
        Path(args.json).write_text(json.dumps({
            "ranks": hvd.size(), "tensors": len(list(base.parameters())),
            "parameters": sum(p.numel() for p in base.parameters()), "batch_size": args.batch_size,
            "steps": args.steps, "density": DENSITY,
            "bytes_sent": {arm: bundle.stats["bytes_sent"] for arm, (_, _, bundle) in arms.items()},
            "times_ms": {arm: [1000 * t for t in ts] for arm, ts in times.items()},
            "paired_ratios": paired,
            "resolve_ns_per_tensor": resolve_cost(compressors, base),
        }))


def summarize(run: dict) -> dict:
    from benchmarks.common.report import median_interval

    def quartiles(samples: list[float]) -> dict[str, float]:
        q1, median, q3 = statistics.quantiles(samples, n=4)
        return {"median": median, "q1": q1, "q3": q3}

    steps = {arm: quartiles(ts) for arm, ts in run["times_ms"].items()}
    topk, legacy = steps["TopK"]["median"], steps["Legacy(TopK)"]["median"]
    resolve = run["resolve_ns_per_tensor"]
    lookup_ms = (resolve["Legacy(TopK)"] - resolve["TopK"]) * run["tensors"] / 1e6
    low, high = median_interval(run["paired_ratios"])
    return {"steps": steps, "ratio_of_medians": legacy / topk, "paired": quartiles(run["paired_ratios"]),
            "paired_median_95": [low, high], "lookup_ms_per_step": lookup_ms, "lookup_share": lookup_ms / topk}


def launch(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.common.report import load_average, machine, run_workers

    before = load_average()
    torch.set_num_threads(1)  # as in the workers, so that the machine line says so
    options = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    if args.quick:
        options.append("--quick")
    run = run_workers("benchmarks.performance.legacy_overhead", 2, *options)
    return {"run": run, "summary": summarize(run), "machine": machine(), "quick": args.quick,
            "load_average": [before, load_average()]}


def write(result: dict, results_dir: Path, command: str) -> None:
    from benchmarks.common.report import load_note, write_report

    run, summary = result["run"], result["summary"]
    sent = run["bytes_sent"]
    same = len(set(sent.values())) == 1
    rows = "\n".join(f"| {arm} | {s['median']:.2f} | {s['q1']:.2f} | {s['q3']:.2f} | {sent[arm]:,} |"
                     for arm, s in summary["steps"].items())
    overhead = summary["ratio_of_medians"] - 1
    paired = summary["paired"]
    resolve = run["resolve_ns_per_tensor"]
    low, high = summary["paired_median_95"]
    met = high < 1 + TARGET
    text = f"""## LEGACY overhead: step time with Legacy(TopK) vs TopK at the same density

`{command}`

Machine: {result['machine']}; {load_note(result['load_average'])} (other jobs add noise; the arms
alternate step by step, ABBA, so slow periods hit both). {run['ranks']} Horovod workers (Gloo), one
thread each; a ResNet-like CNN with {run['tensors']} parameter tensors ({run['parameters']:,}
parameters), batch {run['batch_size']} of synthetic 32x32 images per worker, through
`hvd.DistributedOptimizer` with `Grace(..., Residual())`. TopK at density {run['density']} against
`Legacy(TopK(), by="both")` whose table holds {run['density']} everywhere: the bytes sent are
{'identical' if same else 'NOT identical'} ({', '.join(f'{a}: {b:,}' for a, b in sent.items())}).
{run['steps']} steps per arm; each step's time is the slowest rank's.

| arm | median step ms | q1 | q3 | bytes sent |
|---|---|---|---|---|
{rows}

- Ratio of medians: **{summary['ratio_of_medians']:.4f}** ({100 * overhead:+.2f}%).
- Paired ratio (each LEGACY step over its neighbouring TopK step): median **{paired['median']:.4f}**,
  95% confidence interval of that median {low:.4f} to {high:.4f} (bootstrap); quartiles of the
  ratios {paired['q1']:.4f} to {paired['q3']:.4f}.
- `resolve` per tensor: {resolve['TopK']:.0f} ns for TopK, {resolve['Legacy(TopK)']:.0f} ns for Legacy: LEGACY's
  lookup costs {1000 * summary['lookup_ms_per_step']:.1f} us per step, {100 * summary['lookup_share']:.3f}% of the
  median step.
- Target (LEGACY adds under 1% to step time): {'met' if met else 'NOT met'}: the upper end of the
  paired median's interval is {100 * (high - 1):+.2f}% ({'under' if met else 'not under'} +1%); the lookup
  LEGACY adds is
  {100 * summary['lookup_share']:.3f}% of the step, {'under' if summary['lookup_share'] < TARGET else 'NOT under'} 1%.
"""
    write_report(results_dir, "legacy_overhead", result, text)


def main() -> None:
    from benchmarks.common.report import Repeats, benchmark_main

    benchmark_main("benchmarks.performance.legacy_overhead", __doc__,
                   Repeats("--steps", full=1000, quick=8, warmup=5, quick_warmup=2),
                   worker=worker, launch=launch, write=write, shown=lambda result: result["summary"],
                   options=lambda parser: parser.add_argument("--batch-size", type=int, default=8))


if __name__ == "__main__":
    main()
