"""The accuracy study: every arm on every task, trained by real ``horovodrun -np 4`` workers.

    python -m benchmarks.accuracy.study            # the whole study (about 40 minutes on 2 cores)
    python -m benchmarks.accuracy.study --quick    # a smoke run (a few minutes)

Each task is one ``horovodrun`` launch whose workers train every arm for every seed in turn (one
launch per task amortizes Horovod's start-up; ``--quick`` runs every task in one launch, since
starting the workers is most of a smoke run's cost). For every run the workers record the final metric,
the per-epoch curve, the measured data volume (``stats["volume"]``: bytes this rank handed to
Horovod over bytes a dense send would have) and the wall time. The results are written to
``benchmarks/results/accuracy.md`` (tables, mean +- std over seeds) with plots of accuracy vs data
volume and of the training curves, and the raw runs to ``benchmarks/results/accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer accepts grace_legacy compression)
    from benchmarks.common.arms import ARMS, QUICK_ARMS
    from benchmarks.common.tasks import TASKS, load
    from benchmarks.common.training import run_arms

    hvd.init()
    torch.set_num_threads(1)
    arms = [a for a in ARMS if not args.quick or a.name in QUICK_ARMS]
    runs = []
    for name in args.task.split(","):
        task = TASKS[name]
        build, train, test = load(task, args.quick)
        runs += run_arms(task, arms, args.seeds, build, train, test,
                         task.quick_epochs if args.quick else task.epochs)
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps(runs))


def launch(tasks: list[str], args: argparse.Namespace) -> list[dict]:
    """The runs of one ``horovodrun`` launch that trains ``tasks`` one after the other."""
    from benchmarks.common.report import run_workers

    options = ["--task", ",".join(tasks), "--seeds", str(args.seeds)]
    if args.quick:
        options.append("--quick")
    return run_workers("benchmarks.accuracy.study", 4, *options)


def report(runs: list[dict], results: Path, command: str, elapsed: float, launches: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common.analysis import summarize
    from benchmarks.common.report import machine

    summary = summarize(runs)
    tasks = sorted({task for task, _ in summary})
    colors = {"dense": "black", "uniform": "#c44", "legacy": "#27a", "qsgd": "#a5a", "adaptive": "#e90"}
    lines = ["# Accuracy at equal data volume", "",
             f"`{command}`", "",
             f"Machine: {machine()}. {launches}: one `horovodrun -np 4 -H localhost:4 --gloo` launch; "
             f"whole study {elapsed / 60:.1f} min.", "",
             "Volume is the measured `stats['volume']` (bytes handed to Horovod / bytes of a dense send), "
             "mean over seeds; accuracy and perplexity are on held-out data after the last epoch, "
             "mean +- std over seeds. LEGACY arms are budget-matched to the uniform Top-k arm "
             "(`Legacy.budget_matched`, same expected bytes over the run).", ""]
    figure, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    curves, curve_axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for index, task in enumerate(tasks):
        rows = [(arm, s) for (t, arm), s in summary.items() if t == task]
        metric = rows[0][1]["metric"]
        lines += [f"## {task}", "", f"| arm | volume | {metric} (mean +- std) | seeds | wall time (s) |",
                  "|---|---|---|---|---|"]
        for arm, s in rows:
            lines.append(f"| {arm} | {s['volume']:.4f} | {s['mean']:.4f} +- {s['std']:.4f} | {s['seeds']} | "
                         f"{s['wall_s']:.1f} |")
            axis = axes[0][index]
            axis.errorbar(s["volume"], s["mean"], yerr=s["std"], fmt="o", color=colors.get(s["family"], "gray"))
            axis.annotate(arm, (s["volume"], s["mean"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
            curve_axes[0][index].plot(range(1, len(s["curve"]) + 1), s["curve"], label=arm,
                                      color=colors.get(s["family"], "gray"),
                                      linestyle="-" if "EF" in arm or s["family"] in ("dense", "qsgd") else "--")
        lines.append("")
        axes[0][index].set_xscale("log")
        axes[0][index].set_xlabel("data volume (fraction of dense bytes)")
        axes[0][index].set_ylabel(metric)
        axes[0][index].set_title(task)
        curve_axes[0][index].set_xlabel("epoch")
        curve_axes[0][index].set_ylabel(metric)
        curve_axes[0][index].set_title(task)
    curve_axes[0][-1].legend(fontsize=6)
    lines += ["![accuracy vs data volume](accuracy_vs_volume.png)", "", "![training curves](accuracy_curves.png)", ""]
    results.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(results / "accuracy_vs_volume.png", dpi=120)
    curves.tight_layout()
    curves.savefig(results / "accuracy_curves.png", dpi=120)
    (results / "accuracy.md").write_text("\n".join(lines))
    (results / "accuracy.json").write_text(json.dumps(runs, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few arms, 1 seed, 1 epoch, less data")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--tasks", nargs="*", default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.worker:
        worker(args)
        return
    from benchmarks.common.tasks import TASKS

    start = time.perf_counter()
    tasks = args.tasks or list(TASKS)
    groups = [tasks] if args.quick else [[task] for task in tasks]
    runs = [run for group in groups for run in launch(group, args)]
    command = "python -m benchmarks.accuracy.study" + (" --quick" if args.quick else "")
    report(runs, args.results, command, time.perf_counter() - start, "All tasks" if args.quick else "Each task")
    print(f"wrote {args.results / 'accuracy.md'}")


if __name__ == "__main__":
    main()
