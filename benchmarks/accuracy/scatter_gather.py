"""Accuracy at 8 workers: the ScatterGather route against the Allgather route, paired by seed.

    python -m benchmarks.accuracy.scatter_gather            # digits and charlm, 3 seeds (about an hour)
    python -m benchmarks.accuracy.scatter_gather --quick    # a smoke run: 2 workers, 1 seed, 1 epoch

ScatterGather (``grace_legacy.ScatterGather``) adds a lossy step the Allgather route does not
have: the owner of each shard compresses the mean it computed again (with an error-feedback memory
of its own for a compressor paired with error feedback). This benchmark measures what that costs
in accuracy, at equal compressor settings, on two of the study's tasks
(:mod:`benchmarks.common.tasks`: the CNN on scikit-learn's digits, 12 epochs, and the character
LSTM on Python's standard library sources, 4 epochs), at the study's global batch and learning rate
(:func:`at_study_scale`: 8 workers take half the study's per-worker batch and SGD rate), each
launched as one ``horovodrun -np 8 --gloo`` run on this host (real Horovod workers over loopback, as
the study runs them) whose workers train every arm for every seed in turn
(:func:`benchmarks.common.training.run_arms`).

Arms, each compressor on both routes with ``dense_fallback=False`` (every tensor on the route):

* QSGD(127), unbiased, no error feedback;
* EFSignSGD (its own memory, ``lr`` the task's learning rate);
* Top-k 0.01 with error feedback (``Residual``);

and dense (Horovod's allreduce) for reference. Runs of one seed start from the same weights and
draw the same batches, so the difference ScatterGather - Allgather is paired by seed; its mean
and 95% t interval over the seeds (:func:`benchmarks.common.analysis.paired`) say whether the
second lossy step costs accuracy beyond the noise. Results: ``benchmarks/results/
scatter_gather_accuracy.md``, ``.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
WORKERS = 8
QUICK_WORKERS = 2
#: The accuracy study's workers: its per-worker batch and learning rate are for that many.
STUDY_WORKERS = 4
TASKS = ("digits", "charlm")
COMPRESSORS = ("QSGD(127)", "EFSignSGD", "Top-k 0.01 + EF")
ROUTES = ("scattergather", "allgather")
#: Top-k + EF at equal link bytes at 8 workers: gathering density d costs (P - 1) 8 d per element,
#: scatter-gathering density 4 d about 2 (P - 1) / P 8 (4 d), the same at P = 8.
EQUAL_BYTES = ("Top-k 0.04 + EF scattergather", "Top-k 0.01 + EF allgather")
QUICK_ARMS = ("dense", "Top-k 0.01 + EF scattergather", "Top-k 0.01 + EF allgather")


def arms() -> list[Any]:
    """The arms: dense, then each compressor on each route."""
    import horovod.torch as hvd

    from benchmarks.common.arms import Arm
    from benchmarks.common.training import learning_rate
    from grace_legacy import QSGD, Allgather, EFSignSGD, Grace, Residual, ScatterGather, TopK

    def bundle(compressor: str, route: str) -> Any:
        def build(run: Any) -> Grace:
            communicator = ScatterGather() if route == "scattergather" else Allgather()
            if compressor == "QSGD(127)":
                made, memory = QSGD(127, seed=1), None
            elif compressor == "EFSignSGD":
                made, memory = EFSignSGD(lr=learning_rate(run.task, 0, run.epochs)), None
            else:  # "Top-k D + EF"
                made, memory = TopK(float(compressor.split()[1])), Residual()
            return Grace(made, memory=memory, communicator=communicator, dense_fallback=False)
        return build

    out = [Arm("dense", "dense", False, lambda run: hvd.Compression.none)]
    for compressor in COMPRESSORS:
        for route in ROUTES:
            out.append(Arm(f"{compressor} {route}", route, compressor != "QSGD(127)", bundle(compressor, route)))
    equal = EQUAL_BYTES[0].rsplit(" ", 1)
    out.append(Arm(EQUAL_BYTES[0], equal[1], True, bundle(*equal)))
    return out


def at_study_scale(task: Any, workers: int) -> Any:
    """``task`` with the accuracy study's global batch and learning rate (its 4 workers' per-worker
    batch and rate, shared out over ``workers``): the per-worker rate scaled by the workers, as the
    study scales it, took digits' dense runs at 8 workers to chance accuracy in one seed of three
    (a global rate of 0.16 on 60 steps of batch 256)."""
    from dataclasses import replace

    share = STUDY_WORKERS / workers
    return replace(task, batch_size=max(1, round(task.batch_size * share)),
                   lr=task.lr * share if task.optimizer == "sgd" else task.lr)


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer accepts grace_legacy compression)
    from benchmarks.common.tasks import TASKS as ALL_TASKS
    from benchmarks.common.tasks import load
    from benchmarks.common.training import run_arms

    hvd.init()
    torch.set_num_threads(1)
    task = at_study_scale(ALL_TASKS[args.task], hvd.size())
    build, train, test = load(task, args.quick)
    chosen = [arm for arm in arms() if (not args.quick or arm.name in QUICK_ARMS)
              and (not args.arms or arm.name in args.arms)]
    runs = run_arms(task, chosen, args.seeds, build, train, test, task.quick_epochs if args.quick else task.epochs)
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps(runs))


# -- the driver ------------------------------------------------------------------------------------

def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uptime unavailable"


def paired_rows(runs: list[dict], task: str) -> list[dict[str, Any]]:
    """Per compressor: ScatterGather - Allgather of the final metric, paired by seed."""
    from benchmarks.common.analysis import paired

    mine = [run for run in runs if run["task"] == task]
    rows = []
    pairs = [(compressor, f"{compressor} scattergather", f"{compressor} allgather") for compressor in COMPRESSORS]
    pairs.append(("Top-k + EF, equal link bytes", *EQUAL_BYTES))
    for compressor, scatter, gather in pairs:
        arms_run = {run["arm"] for run in mine}
        if scatter not in arms_run or gather not in arms_run:
            continue
        difference = paired(mine, scatter, gather)
        higher_is_better = mine[0]["metric"] == "accuracy"
        if difference.low > 0 or difference.high < 0:
            better = (difference.low > 0) == higher_is_better
            verdict = "ScatterGather better" if better else "ScatterGather worse"
        else:
            verdict = "within noise"
        rows.append({"compressor": compressor, "mean": difference.mean, "low": difference.low,
                     "high": difference.high, "seeds": difference.seeds, "verdict": verdict})
    return rows


def report(runs: list[dict], results: Path, command: str, elapsed: float, machine: str, load: list[str],
           workers: int) -> None:
    """Write the tables, the paired differences and the plot; the JSON keeps the runs and what the
    header says, so that :func:`main` can write the report again (``--from-json``) or add runs to it
    (``--merge``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common.analysis import summarize
    from benchmarks.common.tasks import TASKS as ALL_TASKS

    summary = summarize(runs)
    tasks = [task for task in TASKS if any(run["task"] == task for run in runs)]
    lines = [f"# Accuracy at {workers} workers: ScatterGather against the Allgather route", "",
             f"`{command}`", "",
             f"Machine: {machine}. Load: `{load[0]}` before and `{load[1]}` after; other jobs shared the "
             f"cores. Each task: one `horovodrun -np {workers} -H localhost:{workers} --gloo` launch (real "
             f"Horovod workers over loopback) training every arm for every seed; {elapsed / 60:.1f} minutes "
             f"in all.", "",
             "Each task at the accuracy study's global batch and learning rate (`at_study_scale`: its "
             "4 workers' per-worker batch and SGD rate shared out over these workers): " + "; ".join(
                 f"{task} batch {scaled.batch_size} per worker, {scaled.optimizer} at "
                 f"{scaled.lr * (workers if scaled.optimizer == 'sgd' else 1):g}"
                 for task in tasks for scaled in [at_study_scale(ALL_TASKS[task], workers)]) + ".", "",
             "Every compressed arm is `Grace(C, memory, communicator=ScatterGather() or Allgather(), "
             "dense_fallback=False)`. *Volume* is the measured `stats['volume']`: link bytes with "
             "bandwidth-optimal algorithms over a dense ring allreduce's, the mean over seeds (each "
             "rank's own; a scatter-gather loads ranks a little unequally). The metric is on held-out "
             "data after the last epoch, mean +- std over seeds. *ScatterGather - Allgather*: the "
             "difference of the final metric paired by seed (same initial weights and batches), its "
             "mean and 95% t interval over the seeds.", ""]
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    out: dict[str, Any] = {"command": command, "machine": machine, "load": load, "elapsed_s": elapsed,
                           "workers": workers, "runs": runs, "paired": {}}
    for index, task in enumerate(tasks):
        rows = [(arm, s) for (t, arm), s in summary.items() if t == task]
        metric = rows[0][1]["metric"]
        lines += [f"## {task}", "", f"| arm | volume | {metric} (mean +- std) | seeds | wall time per run (s) |",
                  "|---|---|---|---|---|"]
        for arm, s in rows:
            lines.append(f"| {arm} | {s['volume']:.4f} | {s['mean']:.4f} +- {s['std']:.4f} | {s['seeds']} | "
                         f"{s['wall_s']:.1f} |")
        pairs = paired_rows(runs, task)
        out["paired"][task] = pairs
        better = "higher" if metric == "accuracy" else "lower"
        lines += ["", f"ScatterGather - Allgather ({metric}, {better} is better):", "",
                  "| compressor | mean difference | 95% interval | seeds | verdict |", "|---|---|---|---|---|"]
        for row in pairs:
            interval = (f"[{row['low']:+.4f}, {row['high']:+.4f}]" if math.isfinite(row["low"])
                        else "(one seed: no interval)")
            lines.append(f"| {row['compressor']} | {row['mean']:+.4f} | {interval} | {row['seeds']} | "
                         f"{row['verdict']} |")
        lines += ["", "*Equal link bytes*: Top-k 0.04 + EF scattergather against Top-k 0.01 + EF allgather, "
                  f"which put the same bytes on each link at {workers} workers (compare their volumes).", ""]
        axis = axes[0][index]
        ys = range(len(pairs))
        for y, row in zip(ys, pairs, strict=True):
            finite = math.isfinite(row["low"])
            error = [[row["mean"] - row["low"]], [row["high"] - row["mean"]]] if finite else None
            axis.errorbar([row["mean"]], [y], xerr=error, fmt="o", color="#a5a", capsize=4)
        axis.axvline(0.0, color="black", linewidth=1)
        axis.set_yticks(list(ys), [row["compressor"] for row in pairs])
        axis.set_xlabel(f"ScatterGather - Allgather, {metric} ({better} is better)")
        axis.set_title(f"{task}: paired by seed, 95% intervals")
        axis.grid(True, axis="x", alpha=0.3)
    lines += ["At equal settings the routes do not send the same thing: a gathered payload reaches every rank "
              "whole, so the update applied is the mean of every rank's payload (for Top-k the union of the "
              "ranks' entries); a scatter-gathered one is summed at its shard's owner and compressed again "
              "before it is applied (for Top-k the owner keeps its shard's share of the density, so the update "
              "is about as sparse as one rank's payload, the rest waiting in the owner's residual), for about "
              "2 / P of the gathered link bytes. The equal-bytes rows compare the two routes at the same link "
              "bytes instead.", "", "![paired differences](scatter_gather_accuracy.png)", ""]
    results.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(results / "scatter_gather_accuracy.png", dpi=120)
    plt.close(figure)
    (results / "scatter_gather_accuracy.md").write_text("\n".join(lines))
    (results / "scatter_gather_accuracy.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    from benchmarks.common.report import benchmark_parser

    parser = benchmark_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--workers", type=int, default=None, help=f"default {WORKERS} ({QUICK_WORKERS} with --quick)")
    parser.add_argument("--arms", nargs="+", help="only these arms (by name)")
    parser.add_argument("--merge", type=Path, help="add this run's runs to those of an earlier report's JSON")
    parser.add_argument("--from-json", type=Path, help="only write the report again, from its JSON")
    parser.add_argument("--task", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.workers is None:
        args.workers = QUICK_WORKERS if args.quick else WORKERS
    if args.worker:
        worker(args)
        return
    from benchmarks.common.limited_link import reproducing_options
    from benchmarks.common.report import machine, run_workers

    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        report(saved["runs"], args.results, saved["command"], saved["elapsed_s"], saved["machine"], saved["load"],
               saved["workers"])
        return
    load = [uptime()]
    start = time.perf_counter()
    runs: list[dict] = []
    for task in args.tasks:
        options = ["--task", task, "--seeds", str(args.seeds)] + (["--quick"] if args.quick else [])
        options += ["--arms", *args.arms] if args.arms else []
        runs += run_workers("benchmarks.accuracy.scatter_gather", args.workers, *options)
    load.append(uptime())
    kept, skip = [], False
    for arg in reproducing_options(sys.argv[1:]):  # without --merge and its file, a path of this machine
        if skip or arg == "--merge":
            skip = not skip
        elif not arg.startswith("--merge="):
            kept.append(arg)
    command = shlex.join(["python", "-m", "benchmarks.accuracy.scatter_gather", *kept])
    elapsed = time.perf_counter() - start
    if args.merge is not None:  # the earlier launch's runs and load first
        saved = json.loads(args.merge.read_text())
        runs = saved["runs"] + runs
        command, load = f"{saved['command']}` then `{command}", [saved["load"][0], load[1]]
        elapsed += saved["elapsed_s"]
    report(runs, args.results, command, elapsed, machine(), load, args.workers)
    print(json.dumps({task: [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                             for row in paired_rows(runs, task)] for task in args.tasks}, indent=1))
    print(f"wrote {args.results / 'scatter_gather_accuracy.md'}")


if __name__ == "__main__":
    main()
