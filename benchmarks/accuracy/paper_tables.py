"""The LEGACY rebuttal's two tables (QSGD on ResNet-9, PowerSGD on ResNet-18), reproduced small.

    python -m benchmarks.accuracy.paper_tables            # both tables, 5 seeds
    python -m benchmarks.accuracy.paper_tables --quick    # a smoke run

Each table is one ``horovodrun -np 4`` launch whose workers train every arm for every seed (see
:mod:`benchmarks.common.paper_arms` for the arms, :mod:`benchmarks.common.resnets` for the
networks). For every arm the report gives the measured volume, the accuracy over seeds, its
difference to the rebuttal's uniform setting and to the uniform setting matched to its bytes
(paired by seed, 95% t interval), and the rebuttal's figure beside ours with a verdict: same
direction, opposite, or within noise. Results go to ``benchmarks/results/paper_tables.md`` and
``paper_tables.png``, the raw runs to ``paper_tables.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.report import machine, parse_study_arguments, run_workers

QUICK_SEEDS, SEEDS = 2, 5
PARTIAL = "paper_tables.partial"   # where workers save the runs so far, under --results


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer accepts grace_legacy compression)
    from benchmarks.common.paper_arms import TABLES, group_table, matched_uniforms, table_arms
    from benchmarks.common.tasks import load
    from benchmarks.common.training import run_arms

    hvd.init()
    torch.set_num_threads(1)
    table = TABLES[args.table]
    task = table.task
    _, train, test = load(task, args.quick)
    epochs = task.quick_epochs if args.quick else task.epochs
    steps = len(train[1]) // hvd.size() // task.batch_size
    model = table.build()
    matching = matched_uniforms(table, model, epochs, steps, hvd.size())
    def result(runs: list[dict]) -> str:
        return json.dumps({"runs": runs, "matching": matching, "groups": group_table(model),
                           "steps_per_epoch": steps, "epochs": epochs, "data": [len(train[1]), len(test[1])]})

    def save(runs: list[dict]) -> None:
        Path(args.partial).write_text(result(runs))

    runs = run_arms(task, table_arms(table, matching), args.seeds, table.build, train, test, epochs,
                    on_run=save if args.partial else None)
    if hvd.rank() == 0:
        Path(args.json).write_text(result(runs))


def _rows(table, result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per arm: measured figures, paired differences, the rebuttal's figure, verdicts."""
    from benchmarks.common.analysis import paired, summarize

    runs = result["runs"]
    summary = {arm: s for (_, arm), s in summarize(runs).items()}
    reference = table.uniform_name(table.paper_uniform)
    uniforms = [arm for arm, s in summary.items() if s["family"] == "uniform"]
    paper_reference = table.paper[reference][0]
    rows = []
    for arm, s in summary.items():
        match = result["matching"]["matches"].get(arm)
        if match is not None:
            matched = table.uniform_name(match["uniform"])
        elif arm in table.adaptive:  # bytes known only after the run: the nearest measured uniform
            matched = min(uniforms, key=lambda u: abs(summary[u]["volume"] - s["volume"]))
        else:
            matched = None
        paper = table.paper.get(arm)
        paper_difference = None if paper is None or arm == reference else paper[0] - paper_reference
        row = {"arm": arm, "family": s["family"], "seeds": s["seeds"], "volume": s["volume"], "mean": s["mean"],
               "std": s["std"], "paper": paper, "paper_difference": paper_difference, "matched": matched}
        if arm != reference:
            row["vs_reference"] = paired(runs, arm, reference)
        if matched is not None:
            row["vs_matched"] = paired(runs, arm, matched)
        rows.append(row)
    return rows


def _section(table, result: dict[str, Any], seeds: int) -> list[str]:
    from benchmarks.common.paper_arms import describe_splits

    runs, task = result["runs"], table.task
    rows = _rows(table, result)
    reference = table.uniform_name(table.paper_uniform)
    lines = [f"## {table.title}", "",
             f"Rebuttal: {table.setup}. Here: the same network with every width / 8 (`benchmarks/accuracy/"
             f"resnets.py`) on the 8x8 digits ({result['data'][0]:,} train / {result['data'][1]:,} test images), "
             f"4 workers x batch {task.batch_size}, "
             f"{result['epochs']} epochs of {result['steps_per_epoch']} steps, SGD (momentum 0.9, weight decay "
             f"{task.weight_decay}) at {4 * task.lr:g} divided by {task.decay:g} at "
             f"{', '.join(f'{m:.0%}' for m in task.milestones)} of the run, {seeds} seeds.", "",
             f"Size groups ({describe_splits()}), this network's parameters:", "",
             "| group | rebuttal's range (elements) | scaled range | tensors | elements |", "|---|---|---|---|---|"]
    total = sum(g["elements"] for g in result["groups"])
    for g in result["groups"]:
        def span(bounds):
            low, high = bounds
            return f"{low:,} -" + (f" {high - 1:,}" if high is not None else "")
        lines.append(f"| {g['group']} | {span(g['paper'])} | {span(g['scaled'])} | {g['tensors']} | "
                     f"{g['elements']:,} ({g['elements'] / total:.1%}) |")
    lines += ["", "Uniform matched to each fixed schedule's expected bytes per step (cost model, the dense fallback "
              "counted; the parameter is an integer, so the nearest):", "",
              "| schedule | expected volume | matched uniform | its expected volume |", "|---|---|---|---|"]
    for arm, m in result["matching"]["matches"].items():
        lines.append(f"| {arm} | {m['expected_volume']:.4f} | {table.uniform_name(m['uniform'])} | "
                     f"{m['uniform_expected_volume']:.4f} |")
    if table.adaptive:
        lines.append(f"| {', '.join(table.adaptive)} | measured | the uniform arm nearest in measured volume | |")
    lines += ["", "Accuracy in %, differences in percentage points, paired by seed with a 95% t interval. The "
              "verdicts compare our interval with the sign of the rebuttal's difference to its uniform "
              f"({reference}): *same direction* or *opposite* when the interval excludes 0, else *within noise*.",
              "",
              "| arm | measured volume | accuracy (mean +- std) | vs " + reference + " | vs matched uniform | "
              "rebuttal: accuracy [volume] | rebuttal vs its uniform | verdict vs " + reference +
              " | verdict vs matched |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paper = "-" if r["paper"] is None else f"{r['paper'][0]:.2f} [{r['paper'][1]:g}%]"
        sign = r["paper_difference"]
        vs_ref = r.get("vs_reference")
        vs_match = r.get("vs_matched")
        lines.append(
            f"| {r['arm']} | {r['volume']:.4f} | {100 * r['mean']:.2f} +- {100 * r['std']:.2f} | "
            f"{vs_ref if vs_ref else 'reference'} | "
            + (f"{vs_match} ({r['matched']})" if vs_match and r["matched"] != r["arm"] else "-") + " | "
            f"{paper} | {'-' if sign is None else f'{sign:+.2f}'} | "
            f"{vs_ref.verdict(sign) if vs_ref and sign is not None else '-'} | "
            f"{vs_match.verdict(sign) if vs_match and sign is not None and r['matched'] != r['arm'] else '-'} |")
    layered = [r for r in runs if r["by_group"] and r["seed"] == 0 and "layer" in r["arm"]]
    for run in layered:
        groups = ", ".join(f"{'SMLH'[int(g)]} {v:.3f}" for g, v in sorted(run["by_group"].items()))
        lines += ["", f"Measured volume by size group, {run['arm']} (seed 0): {groups}. Near 1.000 a group "
                  "travels dense: left uncompressed by the schedule, by PowerSGD (factors of rank r no smaller "
                  "than the matrix) or by the dense fallback (gathering QSGD's int16 levels, s above 127, from 4 "
                  "workers moves as much as a dense allreduce)."]
    lines.append("")
    return lines


def _plot(tables, results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(results), 2, figsize=(12, 4 * len(results)), squeeze=False)
    for row, (key, result) in enumerate(results.items()):
        table = tables[key]
        rows = [r for r in _rows(table, result) if "vs_reference" in r and r["family"] != "dense"]
        left, right = axes[row]
        for y, r in enumerate(rows):
            d = r["vs_reference"]
            left.errorbar(100 * d.mean, y, xerr=[[100 * (d.mean - d.low)], [100 * (d.high - d.mean)]], fmt="o",
                          color="#27a", label="ours (95% interval)" if y == 0 else None)
            if r["paper_difference"] is not None:
                left.plot(r["paper_difference"], y, "x", color="#c44", label="rebuttal (its uniform)")
        left.axvline(0, color="gray", linewidth=0.8)
        left.set_yticks(range(len(rows)), [r["arm"] for r in rows], fontsize=7)
        left.set_xlabel(f"accuracy - {table.uniform_name(table.paper_uniform)} (percentage points)")
        left.set_title(table.title, fontsize=9)
        handles, labels = left.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        left.legend(unique.values(), unique.keys(), fontsize=7)
        for r in _rows(table, result):
            right.errorbar(r["volume"], 100 * r["mean"], yerr=100 * r["std"], fmt="o",
                           color={"dense": "black", "uniform": "#c44", "legacy": "#27a"}.get(r["family"], "#e90"))
            right.annotate(r["arm"], (r["volume"], 100 * r["mean"]), fontsize=6, xytext=(3, 3),
                           textcoords="offset points")
        right.set_xscale("log")
        right.set_xlabel("measured volume (fraction of dense bytes)")
        right.set_ylabel("test accuracy (%), mean +- std over seeds")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_report(results: dict[str, dict], args: argparse.Namespace, timing: str, partial: bool = False) -> None:
    """The report of the tables in ``results`` (all of them, or those finished so far)."""
    from benchmarks.common.paper_arms import TABLES

    command = "python -m benchmarks.accuracy.paper_tables " + " ".join(sys.argv[1:])
    seeds = {key: len({run["seed"] for run in result["runs"]}) for key, result in results.items()}
    lines = ["# The rebuttal's tables, reproduced small", "", f"`{command.strip()}`", "",
             f"Machine: {machine()}. {timing} One `horovodrun -np 4 --gloo` launch per table.", ""]
    if partial:
        lines += ["**Partial**: the runs a launch had finished when it was stopped (from "
                  f"`{PARTIAL}/`).", ""]
    lines += ["Sized for a shared 2-core machine: the networks are ResNet-9/18 at 1/8 width on the 8x8 digits, "
              f"trained {' and '.join(str(r['epochs']) for r in results.values())} epochs (the rebuttal: 30 and "
              f"200 on CIFAR); every arm of the rebuttal is kept. "
              "The rebuttal's volumes come from its own encoding (QSGD at fewer bits per level than "
              "int8), ours are this library's measured bytes.", ""]
    for key, result in results.items():
        lines += _section(TABLES[key], result, seeds[key])
    lines += ["![paired differences and accuracy vs volume](paper_tables.png)", ""]
    args.results.mkdir(parents=True, exist_ok=True)
    _plot(TABLES, results, args.results / "paper_tables.png")
    (args.results / "paper_tables.md").write_text("\n".join(lines))
    (args.results / "paper_tables.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.results / 'paper_tables.md'}")


def main() -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tables", nargs="*", default=["qsgd", "powersgd"], choices=["qsgd", "powersgd"])
        parser.add_argument("--table", help=argparse.SUPPRESS)

    args = parse_study_arguments(__doc__, SEEDS, QUICK_SEEDS, f"{PARTIAL}/", options)
    if args.worker:
        worker(args)
        return
    partial = args.results / PARTIAL
    if args.from_partial:
        results = {path.stem: json.loads(path.read_text()) for path in sorted(partial.glob("*.json"))}
        write_report(results, args, "Timing: see the log of the stopped launch.", partial=True)
        return
    load_before, start = os.getloadavg(), time.perf_counter()
    results, walls = {}, {}
    partial.mkdir(parents=True, exist_ok=True)
    for key in args.tables:
        launched = time.perf_counter()
        options = ["--table", key, "--seeds", str(args.seeds), "--partial", str((partial / f"{key}.json").resolve()),
                   *(["--quick"] if args.quick else [])]
        results[key] = run_workers("benchmarks.accuracy.paper_tables", 4, *options)
        walls[key] = time.perf_counter() - launched
        load_after = os.getloadavg()
        timing = (f"Load average (1, 5, 15 min) {', '.join(f'{x:.1f}' for x in load_before)} before and "
                  f"{', '.join(f'{x:.1f}' for x in load_after)} after; wall time "
                  f"{(time.perf_counter() - start) / 60:.1f} min "
                  f"({', '.join(f'{k} {w / 60:.1f} min' for k, w in walls.items())}).")
        write_report(results, args, timing)   # after each table, so a stopped run keeps the finished ones
    shutil.rmtree(partial)


if __name__ == "__main__":
    main()
