"""What watching for stalled ranks costs a training step: the stall timeout's deadline and beats,
and what posting every step to the progress board would cost.

    python -m benchmarks.performance.stall            # the full run (about 4 minutes here)
    python -m benchmarks.performance.stall --quick    # a smoke run with a tiny model

grace_legacy's backend checks a deadline while it waits and, once a wait has lasted a second,
posts a beat to the progress board (:mod:`grace_legacy.backends.board`); no board traffic at all
while waits are short. This benchmark trains the bandwidth benchmark's CNN
(:mod:`benchmarks.common.step_models`) with ``Grace(TopK(0.001), memory=Residual())`` on 2
loopback workers, Horovod over Gloo, three ways side by side, interleaved step by step:
*unwatched* (the backend's wait replaced by the plain sleeping wait, no deadline, no board),
*watched* (as shipped) and *watched + post each step* (as shipped, plus one post of the step
number to the board at the end of every step, the design the board does not use), their order
rotating from one iteration to the next. A step is
timed from forward to the end of ``optimizer.step()`` on every rank after a barrier; the
slowest rank's time counts. Results: ``benchmarks/results/performance.md`` (section "stall") and
``stall.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DENSITY = 0.001
WAYS = ("unwatched", "watched", "watched + post each step")
WORKERS = 2


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (lets hvd.DistributedOptimizer take grace_legacy compression)
    from benchmarks.common.step_models import build
    from benchmarks.common.training import broadcast_parameters
    from grace_legacy import Grace, Residual, TopK
    from grace_legacy.backends.board import ProgressBoard
    from grace_legacy.backends.horovod import synchronize

    hvd.init()
    torch.set_num_threads(1)
    ways = {}
    for way in WAYS:
        step_model = build("resnet", args.quick, seed=0, data_seed=hvd.rank())
        named = [(f"{way}.{n}", p) for n, p in step_model.model.named_parameters()]
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(step_model.model.parameters(), lr=1e-3, momentum=0.9),
                                             named_parameters=named,
                                             compression=Grace(TopK(DENSITY), memory=Residual()))
        if way == "unwatched":
            optimizer._grace_backend.wait = lambda launched: launched.finish(synchronize)
        broadcast_parameters(step_model.model.state_dict())
        ways[way] = (step_model, optimizer)
    flag = torch.zeros(1)
    measured: dict[str, list[float]] = {way: [] for way in WAYS}
    for iteration in range(args.warmup + args.steps):
        # Each way takes each place in the rotation equally often: the first step after the
        # harness's barrier is not the same as the last.
        turn = iteration % len(WAYS)
        for way in WAYS[turn:] + WAYS[:turn]:
            step_model, optimizer = ways[way]
            synchronize(hvd.allreduce_async(flag, name="stall.barrier"))
            start = time.perf_counter()
            optimizer.zero_grad()
            step_model.loss().backward()
            optimizer.step()
            if way == "watched + post each step":
                board = optimizer._grace_backend.board
                board._store.set(ProgressBoard.key(board.board, board.rank), f"{iteration}|step")
            elapsed = time.perf_counter() - start
            slowest = synchronize(hvd.allreduce_async(torch.tensor([elapsed], dtype=torch.float64),
                                                      name="stall.slowest", op=hvd.Max)).item()
            if iteration >= args.warmup:
                measured[way].append(slowest)
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps({"workers": hvd.size(), "measured": measured}))


def summarise(run: dict) -> dict:
    """Medians per way, and the median (with a 95% bootstrap interval) of the per-iteration
    ratios of each watched way to the unwatched one."""
    from benchmarks.common.report import median_interval

    measured = run["measured"]
    summary = {"step_s": {way: statistics.median(times) for way, times in measured.items()}}
    for way in WAYS[1:]:
        ratios = [w / u for w, u in zip(measured[way], measured["unwatched"], strict=True)]
        summary[f"{way} / unwatched"] = [statistics.median(ratios), *median_interval(ratios)]
    return summary


def launch(args: argparse.Namespace) -> dict:
    import torch

    from benchmarks.common.report import load_average, machine, run_workers

    before = load_average()
    torch.set_num_threads(1)
    options = ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--quick"] if args.quick else [])
    run = run_workers("benchmarks.performance.stall", WORKERS, *options)
    run["summary"] = summarise(run)
    return {"run": run, "machine": machine(), "quick": args.quick, "steps": args.steps,
            "load_average": [before, load_average()]}


def write(result: dict, results_dir: Path, command: str) -> None:
    from benchmarks.common.report import load_note, write_report

    summary = result["run"]["summary"]
    rows = [f"| {way} | **{summary['step_s'][way]:.3f}** | "
            + ("1 (reference)" if way == "unwatched" else
               "{:.3f} ({:.3f}-{:.3f})".format(*summary[f"{way} / unwatched"])) + " |" for way in WAYS]
    verdicts = []
    for way in WAYS[1:]:
        ratio, low, high = summary[f"{way} / unwatched"]
        verdicts.append(f"- *{way}*: " + ("no cost this run can tell from its noise (the interval holds 1)."
                                          if low <= 1 <= high else
                                          f"{ratio:.3f}x the unwatched step (the interval excludes 1)."))
    text = f"""## Watching for stalled ranks: cost per step

`{command}`

Machine: {result['machine']}; {load_note(result['load_average'])}. Horovod over Gloo on loopback,
{WORKERS} workers; the bandwidth benchmark's ResNet-like CNN{' (quick: tiny)' if result['quick'] else ''},
one thread per worker, `Grace(TopK({DENSITY}), memory=Residual())`. *Unwatched*: the backend's wait
without deadline or board; *watched*: as shipped (deadline, beats only in waits over a second);
*watched + post each step*: as shipped plus one post to the progress board per step and rank. The
ways alternate step by step; {result['steps']} timed steps each. *Step s*: median of the slowest
rank's step; *ratio*: median of the per-iteration ratios to the unwatched step (95% bootstrap
interval). The ways take turns in a rotating order.

| way | step s | ratio to unwatched |
|---|---|---|
{chr(10).join(rows)}

{chr(10).join(verdicts)}
"""
    write_report(results_dir, "stall", result, text)


def main() -> None:
    from benchmarks.common.report import Repeats, benchmark_main

    benchmark_main("benchmarks.performance.stall", __doc__, Repeats("--steps", full=30, quick=3, warmup=2),
                   worker=worker, launch=launch, write=write, shown=lambda result: result["run"]["summary"])


if __name__ == "__main__":
    main()
