"""Waiting for collectives asleep vs Horovod's spinning wait: training step time and CPU time.

    python -m benchmarks.performance.waiting            # the full run (about 3 minutes here)
    python -m benchmarks.performance.waiting --quick    # a smoke run with tiny models

Horovod's ``synchronize`` waits by calling ``sched_yield`` in a loop; grace_legacy's backend polls
between sleeps instead (:func:`grace_legacy.backends.horovod.synchronize`). This benchmark trains
the bandwidth benchmark's CNN (:mod:`benchmarks.common.step_models`) on loopback, Horovod over
Gloo, three ways side by side, interleaved step by step: *compute only* (no communication),
*Top-k asleep* (``Grace(TopK(0.001), memory=Residual())`` as shipped) and *Top-k spinning* (the
same, its backend's wait replaced by ``hvd.synchronize``). It runs twice: 4 workers (more workers
than cores on the 2-core development machine) and 2 workers. A step is timed from forward to the
end of ``optimizer.step()`` on every rank after a barrier; the slowest rank's time counts, and
each rank's process CPU time over the step (all its threads: Horovod's and Gloo's too) is
averaged over the ranks. The harness's own barrier and timing exchange wait asleep, so that no
way is slowed by ranks spinning in them. Results: ``benchmarks/results/performance.md`` (section
"waiting") and ``waiting.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DENSITY = 0.001
WAYS = ("compute only", "Top-k asleep", "Top-k spinning")
WORLD_SIZES = (4, 2)


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (lets hvd.DistributedOptimizer take grace_legacy compression)
    from benchmarks.common.step_models import build
    from benchmarks.common.training import broadcast_parameters
    from grace_legacy import Grace, Residual, TopK
    from grace_legacy.backends.horovod import synchronize

    hvd.init()
    torch.set_num_threads(1)
    ways = {}
    for way in WAYS:
        step_model = build("resnet", args.quick, seed=0, data_seed=hvd.rank())
        optimizer = torch.optim.SGD(step_model.model.parameters(), lr=1e-3, momentum=0.9)
        if way != "compute only":
            named = [(f"{way}.{n}", p) for n, p in step_model.model.named_parameters()]
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                                 compression=Grace(TopK(DENSITY), memory=Residual()))
            if way == "Top-k spinning":
                optimizer._grace_backend.wait = lambda launched: launched.finish(hvd.synchronize)
            broadcast_parameters(step_model.model.state_dict())
        ways[way] = (step_model, optimizer)
    flag = torch.zeros(1)
    measured: dict[str, dict[str, list[float]]] = {way: {"step_s": [], "cpu_s": []} for way in WAYS}
    for iteration in range(args.warmup + args.steps):
        for way, (step_model, optimizer) in ways.items():
            synchronize(hvd.allreduce_async(flag, name="waiting.barrier"))
            cpu, start = time.process_time(), time.perf_counter()
            optimizer.zero_grad()
            step_model.loss().backward()
            optimizer.step()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            slowest = synchronize(hvd.allreduce_async(torch.tensor([elapsed], dtype=torch.float64),
                                                      name="waiting.slowest", op=hvd.Max)).item()
            mean_cpu = synchronize(hvd.allreduce_async(torch.tensor([cpu], dtype=torch.float64),
                                                       name="waiting.cpu", op=hvd.Average)).item()
            if iteration >= args.warmup:
                measured[way]["step_s"].append(slowest)
                measured[way]["cpu_s"].append(mean_cpu)
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps({"workers": hvd.size(), "measured": measured}))


def summarise(run: dict) -> dict:
    """Medians per way, and the median (with a 95% bootstrap interval) of the per-iteration
    ratios of the spinning step to the sleeping one."""
    from benchmarks.common.report import median_interval

    measured = run["measured"]
    ratios = [spin / asleep for spin, asleep in zip(measured["Top-k spinning"]["step_s"],
                                                      measured["Top-k asleep"]["step_s"], strict=True)]
    return {"step_s": {way: statistics.median(m["step_s"]) for way, m in measured.items()},
            "cpu_s": {way: statistics.median(m["cpu_s"]) for way, m in measured.items()},
            "spinning_over_asleep": statistics.median(ratios),
            "spinning_over_asleep_95": list(median_interval(ratios))}


def launch(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.common.report import load_average, machine, run_workers

    before = load_average()
    torch.set_num_threads(1)  # as in the workers, so that the machine line says so
    options = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.quick:
        options.append("--quick")
    runs = []
    for workers in WORLD_SIZES:
        run = run_workers("benchmarks.performance.waiting", workers, *options)
        run["summary"] = summarise(run)
        runs.append(run)
    return {"runs": runs, "machine": machine(), "quick": args.quick, "steps": args.steps,
            "load_average": [before, load_average()]}


def write(result: dict, results_dir: Path, command: str) -> None:
    from benchmarks.common.report import load_note, write_report

    rows, verdicts = [], []
    for run in result["runs"]:
        summary = run["summary"]
        for way in WAYS:
            rows.append(f"| {run['workers']} | {way} | **{summary['step_s'][way]:.3f}** "
                        f"| {summary['cpu_s'][way]:.3f} |")
        low, high = summary["spinning_over_asleep_95"]
        verdicts.append(f"- {run['workers']} workers: the spinning Top-k step takes "
                        f"**{summary['spinning_over_asleep']:.2f}x** the sleeping one's (median of the "
                        f"per-iteration ratios, 95% interval {low:.2f}-{high:.2f}); per rank, "
                        f"{summary['cpu_s']['Top-k spinning']:.3f} s of CPU a step against "
                        f"{summary['cpu_s']['Top-k asleep']:.3f} s.")
    text = f"""## Waiting for collectives: asleep (grace_legacy) vs spinning (Horovod's wait)

`{command}`

Machine: {result['machine']}; {load_note(result['load_average'])}. Horovod over Gloo on
loopback; the bandwidth benchmark's ResNet-like CNN{' (quick: tiny)' if result['quick'] else ''}, one
thread per worker; *Top-k* is `Grace(TopK({DENSITY}), memory=Residual())`, *spinning* the same with
its backend's wait replaced by `hvd.synchronize`. The ways alternate step by step; {result['steps']}
timed steps each. *Step s*: median of the slowest rank's step; *CPU s*: median of the ranks' mean
process CPU time per step (all threads).

| workers | way | step s | CPU s |
|---|---|---|---|
{chr(10).join(rows)}

{chr(10).join(verdicts)}
"""
    write_report(results_dir, "waiting", result, text)


def main() -> None:
    from benchmarks.common.report import Repeats, benchmark_main

    benchmark_main("benchmarks.performance.waiting", __doc__, Repeats("--steps", full=30, quick=3, warmup=3),
                   worker=worker, launch=launch, write=write,
                   shown=lambda result: [run["summary"] for run in result["runs"]])


if __name__ == "__main__":
    main()
