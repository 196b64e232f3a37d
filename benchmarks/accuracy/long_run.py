"""LEGACY by epoch on a run long enough for dense training to converge.

    python -m benchmarks.accuracy.long_run            # 11 arms x 5 seeds x 60 epochs
    python -m benchmarks.accuracy.long_run --quick    # a smoke run

The accuracy study's runs are 4-12 epochs; the paper's by-epoch claim is about long training with
learning-rate decay, where the early phase is said to matter most. Here the study's digits CNN
trains 60 epochs (the rate divided by 10 at half and three quarters of the run), by real
``horovodrun -np 4`` workers, with Top-k at the study's uniform density and every LEGACY arm
budget-matched to it (``Legacy.budget_matched``): uniform; by epoch in two shapes, the paper's
equal thirds (2x, 1x, 0.5x) and early-heavy (the first 10% of the run at 5x the rest's density);
by layer; by layer and thirds; each with and without error feedback; dense as the reference.
Differences to the uniform arm of the same error feedback are paired by seed (95% t interval), at
the end and at the end of each third of the run. Results go to ``benchmarks/results/long_run.md``
(+ ``long_run.png``, ``long_run.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.report import machine, parse_study_arguments, run_workers
from benchmarks.common.tasks import Task

QUICK_SEEDS, SEEDS = 2, 5
PARTIAL = "long_run.partial.json"   # where rank 0 saves the runs so far, under --results
EARLY_FACTORS, EARLY_SHARE = [5, 1], 0.1
# The study's digits CNN and data; batches of 64 a worker (5 steps an epoch) so that 55 runs of 60
# epochs fit a shared 2-core machine, where a step costs mostly the 4 workers' meeting. The study's
# rate (4 x 0.02): twice that diverged within the first 10 epochs for some seeds, dense included.
TASK = Task("digits-60", "accuracy", epochs=60, batch_size=64, lr=0.02, optimizer="sgd", split=10_000,
            quick_epochs=3, milestones=(0.5, 0.75), data="digits")


def arms() -> list:
    from benchmarks.common.arms import DENSITY, Arm, legacy_topk
    from benchmarks.common.paper_arms import DENSE
    from grace_legacy import Grace, NoMemory, Residual, TopK

    shapes = [("LEGACY epoch thirds", "epoch", {}), ("LEGACY epoch early", "epoch",
                                                     {"phase_factors": EARLY_FACTORS, "first_phase": EARLY_SHARE}),
              ("LEGACY layer", "layer", {}), ("LEGACY both", "both", {})]
    out = [DENSE]
    for ef in (False, True):
        suffix = " + EF" if ef else ""
        memory = Residual if ef else NoMemory
        out.append(Arm("uniform Top-k" + suffix, "uniform", ef,
                       lambda run, memory=memory: Grace(TopK(DENSITY), memory=memory())))
        out += [Arm(name + suffix, "legacy", ef, legacy_topk(by, ef, **shape)) for name, by, shape in shapes]
    return out


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer accepts grace_legacy compression)
    from benchmarks.common.tasks import load
    from benchmarks.common.training import run_arms

    hvd.init()
    torch.set_num_threads(1)
    build, train, test = load(TASK, args.quick)
    epochs = TASK.quick_epochs if args.quick else TASK.epochs
    def save(runs: list[dict], path: str) -> None:
        Path(path).write_text(json.dumps({"runs": runs, "data": [len(train[1]), len(test[1])]}))

    runs = run_arms(TASK, arms(), args.seeds, build, train, test, epochs,
                    on_run=(lambda runs: save(runs, args.partial)) if args.partial else None)
    if hvd.rank() == 0:
        save(runs, args.json)


def _uniform_of(arm: str) -> str:
    return "uniform Top-k + EF" if arm.endswith(" + EF") else "uniform Top-k"


def _checkpoints(epochs: int) -> list[int]:
    """The last epoch (0-based) of each third of the run."""
    return sorted({max(0, round(epochs * k / 3) - 1) for k in (1, 2, 3)})


def report_lines(runs: list[dict[str, Any]], epochs: int) -> list[str]:
    from benchmarks.common.analysis import paired, summarize

    summary = {arm: s for (_, arm), s in summarize(runs).items()}
    checkpoints = _checkpoints(epochs)
    dense = summary["dense"]["curve"]
    tail = dense[-max(2, epochs // 4):]
    plateau = max(tail) - min(tail)
    lines = ["## Did dense training converge?", "",
             f"Dense held-out accuracy (mean over seeds) at the end of each third: "
             f"{', '.join(f'epoch {c + 1}: {100 * dense[c]:.2f}%' for c in checkpoints)}. Over the last "
             f"{len(tail)} epochs it moves within {100 * plateau:.2f} percentage points "
             f"({'a plateau' if plateau < 0.01 else 'not yet a plateau'}: the criterion is under 1 point).", "",
             "## Accuracy at equal volume", "",
             "Accuracy in %; differences in percentage points to the uniform Top-k arm with the same error "
             "feedback, paired by seed with a 95% t interval, at the end of each third of the run (epoch "
             f"{', '.join(str(c + 1) for c in checkpoints)}).", "",
             "| arm | measured volume | final accuracy (mean +- std) | "
             + " | ".join(f"vs uniform, epoch {c + 1}" for c in checkpoints) + " | verdict (final) |",
             "|---|---|---|" + "---|" * len(checkpoints) + "---|"]
    verdicts: dict[str, str] = {}
    for arm, s in summary.items():
        cells = ["-"] * len(checkpoints)
        verdict = "-"
        if s["family"] == "legacy":
            differences = [paired(runs, arm, _uniform_of(arm), "curve", c) for c in checkpoints]
            cells = [str(d) for d in differences]
            verdict = verdicts[arm] = differences[-1].verdict()
        lines.append(f"| {arm} | {s['volume']:.4f} | {100 * s['mean']:.2f} +- {100 * s['std']:.2f} | "
                     + " | ".join(cells) + f" | {verdict} |")
    by_epoch = {arm: v for arm, v in verdicts.items() if "epoch" in arm}
    counts = {v: sum(1 for x in by_epoch.values() if x == v) for v in ("better", "worse", "within noise")}
    if counts["better"] == len(by_epoch):
        claim = "holds at this scale: every by-epoch arm ends above uniform Top-k at equal volume"
    elif counts["better"] == 0:
        claim = ("does not hold at this scale: no by-epoch arm ends significantly above uniform Top-k at equal "
                 "volume")
    else:
        claim = "is mixed at this scale"
    lines += ["", f"**The by-epoch claim {claim}** (of {len(by_epoch)} by-epoch comparisons: "
              f"{counts['better']} better, {counts['worse']} worse, {counts['within noise']} within noise; "
              f"final accuracy, 95% intervals paired by seed).", ""]
    return lines


def _plot(runs: list[dict[str, Any]], epochs: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common.analysis import summarize

    summary = {arm: s for (_, arm), s in summarize(runs).items()}
    figure, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    x = range(1, epochs + 1)
    colors = {"uniform": "#c44", "thirds": "#27a", "early": "#2a7", "layer": "#a5a", "both": "#e90"}
    for column, ef in enumerate((False, True)):
        top, bottom = axes[0][column], axes[1][column]
        top.plot(x, [100 * v for v in summary["dense"]["curve"]], color="black", label="dense")
        for arm, s in summary.items():
            if s["family"] == "dense" or arm.endswith(" + EF") != ef:
                continue
            color = next(c for key, c in colors.items() if key in arm)
            top.plot(x, [100 * v for v in s["curve"]], color=color, label=arm)
            if s["family"] == "legacy":
                mine = {r["seed"]: r["curve"] for r in runs if r["arm"] == arm}
                theirs = {r["seed"]: r["curve"] for r in runs if r["arm"] == _uniform_of(arm)}
                gap = [100 * statistics.fmean(mine[k][e] - theirs[k][e] for k in mine.keys() & theirs.keys())
                       for e in range(epochs)]
                bottom.plot(x, gap, color=color, label=arm)
        for axis in (top, bottom):
            for third in (1, 2):
                axis.axvline(epochs * third / 3 + 0.5, color="#27a", linestyle=":", linewidth=0.8)
            for milestone in TASK.milestones:
                axis.axvline(milestone * epochs + 0.5, color="gray", linestyle="--", linewidth=0.8)
            axis.axvline(max(1, round(EARLY_SHARE * epochs)) + 0.5, color="#2a7", linestyle=":", linewidth=0.8)
        bottom.axhline(0, color="black", linewidth=0.8)
        top.set_title(("with" if ef else "without") + " error feedback (dotted: phase ends; dashed: lr / 10)",
                      fontsize=9)
        top.set_ylabel("held-out accuracy (%), mean over seeds")
        top.set_ylim(bottom=max(0, min(100 * min(s["curve"][epochs // 3:]) for s in summary.values()) - 5))
        bottom.set_ylabel("minus uniform Top-k (points), mean of paired")
        bottom.set_xlabel("epoch")
        top.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    args = parse_study_arguments(__doc__, SEEDS, QUICK_SEEDS, PARTIAL)
    if args.worker:
        worker(args)
        return
    partial = (args.results / PARTIAL).resolve()
    if args.from_partial:
        result = json.loads(partial.read_text())
        timing = f"**Partial**: the runs a stopped launch had finished (from `{PARTIAL}`); timing in its log."
    else:
        load_before, start = os.getloadavg(), time.perf_counter()
        args.results.mkdir(parents=True, exist_ok=True)
        result = run_workers("benchmarks.accuracy.long_run", 4, "--seeds", str(args.seeds), "--partial", str(partial),
                             *(["--quick"] if args.quick else []))
        elapsed, load_after = time.perf_counter() - start, os.getloadavg()
        timing = (f"Load average (1, 5, 15 min) {', '.join(f'{x:.1f}' for x in load_before)} before and "
                  f"{', '.join(f'{x:.1f}' for x in load_after)} after; wall time {elapsed / 60:.1f} min, one "
                  "`horovodrun -np 4 --gloo` launch.")
    runs = result["runs"]
    epochs, steps = runs[0]["epochs"], runs[0]["steps_per_epoch"]
    seeds = len({run["seed"] for run in runs})
    command = "python -m benchmarks.accuracy.long_run " + " ".join(sys.argv[1:])
    lines = ["# LEGACY by epoch on a long run", "", f"`{command.strip()}`", "",
             f"Machine: {machine()}. {timing}", "",
             f"The study's digits CNN on the 8x8 digits ({result['data'][0]:,} train / {result['data'][1]:,} "
             f"held-out images), 4 workers x batch {TASK.batch_size}, {epochs} epochs of {steps} steps, SGD "
             f"(momentum 0.9) at {4 * TASK.lr:g} divided by {TASK.decay:g} at "
             f"{', '.join(f'{m:.0%}' for m in TASK.milestones)} of the run, {seeds} seeds. Top-k at the "
             "study's density 0.01; LEGACY arms budget-matched to it: by epoch in equal thirds at 2x, 1x, 0.5x "
             f"(the paper's shape) or early-heavy (the first {EARLY_SHARE:.0%} of the run at {EARLY_FACTORS[0]}x "
             f"the rest's density), by layer (tensors under {TASK.split:,} elements at 10x), both (layer x "
             "thirds). Sized for a shared 2-core machine: batches of 64 a worker (the study: 32), "
             f"{epochs} epochs, {seeds} seeds; no arm dropped.", ""]
    lines += report_lines(runs, epochs)
    lines += ["![per-phase accuracy curves](long_run.png)", ""]
    args.results.mkdir(parents=True, exist_ok=True)
    _plot(runs, epochs, args.results / "long_run.png")
    (args.results / "long_run.md").write_text("\n".join(lines))
    (args.results / "long_run.json").write_text(json.dumps(result, indent=1))
    if not args.from_partial:
        partial.unlink(missing_ok=True)
    print(f"wrote {args.results / 'long_run.md'}")


if __name__ == "__main__":
    main()
