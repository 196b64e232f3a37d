"""Horovod on a fast link: grace_legacy's ``FP16`` against Horovod's own ``hvd.Compression.fp16``.

    python -m benchmarks.performance.horovod_fast_links            # the full run (a few minutes here)
    python -m benchmarks.performance.horovod_fast_links --quick    # a smoke run

Four ``horovodrun --gloo`` workers on loopback (no rate limit: what the hook does on the CPU
decides the step) train the CNN of :mod:`benchmarks.performance.fast_links`, three copies from one
seed, each behind its own ``hvd.DistributedOptimizer``: Horovod's ``Compression.none`` (the floor),
``Compression.fp16``, and grace_legacy's ``FP16()``. Each iteration runs every way once, in an order
that reverses from one iteration to the next; a step's time is the slowest rank's. A ratio is
Horovod's / ours for the same iteration (above 1: ours faster); the run is cut into ``--repeats``
blocks, each block's median one repeat. The DDP comparison is ``fast_links``; this one keeps the
Horovod path honest. Results: ``benchmarks/results/performance.md`` (section "horovod_fast_links")
and ``horovod_fast_links.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

WORKERS = 4
REPEATS = 6
NONE, HOROVOD_FP16, GRACE_FP16 = "hvd none", "hvd fp16", "grace FP16"
WAYS = (NONE, HOROVOD_FP16, GRACE_FP16)
#: Horovod's fp16 / ours: at least this (issue #35: keep the Horovod path ahead of Horovod's own).
TARGET = 1.0


def worker(args: argparse.Namespace) -> None:
    import copy

    import horovod.torch as hvd
    import torch

    from benchmarks.common.step_models import ResNetLike, slowest_horovod_step
    from benchmarks.performance.fast_links import BATCH, QUICK_BATCH, QUICK_WIDTHS, WIDTHS
    from grace_legacy import FP16

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = ResNetLike(QUICK_WIDTHS if args.quick else WIDTHS)
    compressions = {NONE: hvd.Compression.none, HOROVOD_FP16: hvd.Compression.fp16, GRACE_FP16: FP16()}
    ways = {}
    for index, (way, compression) in enumerate(compressions.items()):
        model = copy.deepcopy(base)
        named = [(f"way{index}.{name}", p) for name, p in model.named_parameters()]
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
                                             named_parameters=named, compression=compression)
        ways[way] = (model, optimizer)
    data = torch.Generator().manual_seed(hvd.rank())
    batch = QUICK_BATCH if args.quick else BATCH
    inputs, targets = torch.randn(batch, 3, 32, 32, generator=data), torch.randint(0, 10, (batch,), generator=data)

    def step(way: str) -> float:
        return slowest_horovod_step(*ways[way], inputs, targets)

    for _ in range(args.warmup):
        for way in WAYS:
            step(way)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for iteration in range(args.steps):
        for way in (WAYS if iteration % 2 == 0 else WAYS[::-1]):
            times[way].append(step(way))
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps({"ranks": hvd.size(), "times_s": times,
                                               "parameters": sum(p.numel() for p in base.parameters())}))


def summarize(times: dict[str, list[float]], repeats: int) -> dict:
    """The per-iteration ratios Horovod's fp16 / ours cut into ``repeats`` blocks: each block's
    median, their median and range, and the 95% interval of the median over all iterations."""
    from benchmarks.common.report import median_interval

    paired = [theirs / ours for ours, theirs in zip(times[GRACE_FP16], times[HOROVOD_FP16], strict=True)]
    size = max(1, len(paired) // repeats)
    blocks = [statistics.median(paired[i:i + size]) for i in range(0, size * repeats, size) if paired[i:i + size]]
    return {"per_repeat": blocks, "median": statistics.median(blocks), "range": [min(blocks), max(blocks)],
            "interval": list(median_interval(paired)), "met": statistics.median(blocks) >= TARGET}


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.report import load_average, machine, run_workers

    before = load_average()
    options = ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--quick"] if args.quick else [])
    run = run_workers("benchmarks.performance.horovod_fast_links", WORKERS, *options)
    return {"run": run, "ratio": summarize(run["times_s"], REPEATS), "machine": machine(), "quick": args.quick,
            "steps": args.steps, "load_average": [before, load_average()]}


def write(result: dict, results_dir: Path, command: str) -> None:
    from benchmarks.common.report import load_note, median_interval, write_report

    run, ratio = result["run"], result["ratio"]
    floor = statistics.median(run["times_s"][NONE])
    rows = []
    for way in WAYS:
        low, high = median_interval(run["times_s"][way])
        median = statistics.median(run["times_s"][way])
        rows.append(f"| {way} | {1e3 * median:.1f} ({1e3 * low:.1f}-{1e3 * high:.1f}) | {median / floor:.2f}x |")
    nl = "\n"
    text = f"""## Horovod on a fast link: grace_legacy's FP16 against hvd.Compression.fp16 (loopback)

`{command}`

Machine: {result['machine']}; {load_note(result['load_average'])}. {run['ranks']} `horovodrun --gloo`
workers on loopback, one thread each; the fast-link CNN ({run['parameters']:,} parameters), one
`hvd.DistributedOptimizer` per way, {result['steps']} iterations, each way once per iteration in an
order reversing every iteration; a step's time is the slowest rank's. A ratio is Horovod's fp16 /
ours in the same iteration (above 1: ours faster); a repeat is the median over a block of
{result['steps'] // REPEATS} iterations.

- **FP16**: hvd fp16 / grace FP16 = **{ratio['median']:.3f}x** (median of {len(ratio['per_repeat'])} repeats'
  medians; range {ratio['range'][0]:.3f}-{ratio['range'][1]:.3f}; 95% interval of the median over all
  iterations {ratio['interval'][0]:.3f}-{ratio['interval'][1]:.3f}); target >= {TARGET}:
  {'met' if ratio['met'] else 'not met'}.

| way | step ms (median, 95% interval) | vs hvd none |
|---|---|---|
{nl.join(rows)}
"""
    write_report(results_dir, "horovod_fast_links", result, text)


def main() -> None:
    from benchmarks.common.report import Repeats, benchmark_main

    benchmark_main("benchmarks.performance.horovod_fast_links", __doc__,
                   Repeats("--steps", full=120, quick=6, warmup=5, quick_warmup=2),
                   worker=worker, launch=launch, write=write, shown=lambda result: result["ratio"])


if __name__ == "__main__":
    main()
