"""Accuracy against the number of workers, 4 to 256, simulated (``grace_legacy.simulate``): uniform
Top-0.1% + EF, LEGACY by layer and by epoch budget-matched to it, QSGD and EF-signSGD gathered and
two-phase, dense; and the LEGACY abstract's sentence that it "scales effectively to a 100-worker
configuration while maintaining strong accuracy under aggressive compression", tested.

    nice -n 10 python -m benchmarks.accuracy.many_workers            # every run the JSON lacks (hours)
    nice -n 10 python -m benchmarks.accuracy.many_workers --workers 128 4 --arms dense "LEGACY layer + EF"
    python -m benchmarks.accuracy.many_workers --report              # the report again, from the JSON
    python -m benchmarks.accuracy.many_workers --quick               # a smoke run (a minute)

mnist1d's MLP (``benchmarks/common/tasks.py``), where uniform Top-0.1% leaves dense's accuracy far
behind (the headroom a schedule could win back), trained by ``W`` simulated workers sharing a fixed
global batch (:mod:`benchmarks.common.simulated`: the same data every step at any ``W``, so the
runs of a seed pair across arms and across worker counts). Each run is kept in
``benchmarks/results/many_workers.json`` as soon as it ends, so a stopped launch loses one run, and
a launch runs only the runs the JSON lacks (``--workers``, ``--arms`` and ``--seeds`` choose them):
the study runs in parts. Accuracy does not depend on the machine's load (``nice`` it).

The report (``many_workers.md``, ``.png``) gives at each ``W`` every arm's accuracy and measured wire
volume, paired 95% intervals against uniform Top-0.1% + EF and against dense, each arm's change from
4 to the largest ``W``, the verdict on the abstract's sentence in ``paper_tables``' words, and time to
accuracy projected at 128 workers (simulated steps times compute plus the planner's link time).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common.report import RESULTS, machine

WORKERS = (4, 16, 64, 128, 256)
SEEDS, QUICK_SEEDS = 5, 2
#: Where an arm runs only when named by --arms: every worker of the two-phase route compresses a
#: segment for every owner, W of them a step, so a step's work grows as W^2 (the runs' wall times
#: are in the JSON; at 128 workers these are the study's slowest).
SLOW_AT = {"QSGD s=2 two-phase": 128, "EF-signSGD two-phase": 128, "EF-signSGD two-phase, no owner feedback": 64,
           "Top-0.1% + EF two-phase": 64, "Top-0.1% + EF two-phase, no owner feedback": 64}
QUICK_WORKERS = (4, 8)
QUICK_ARMS = ("dense", "uniform Top-0.1% + EF", "LEGACY layer + EF", "QSGD s=2 two-phase")
NAME = "many_workers"


def _planned(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(arm, workers, seed) of every run asked for, the largest and smallest worker counts first
    (the abstract's sentence needs both ends), seed by seed."""
    from benchmarks.common.simulated import ARMS

    names = args.arms or ([a for a in QUICK_ARMS] if args.quick else [a.name for a in ARMS])
    counts = sorted(args.workers, key=lambda w: (w not in (max(args.workers), min(args.workers)), -w))
    return [(arm, workers, seed) for workers in counts for seed in range(args.seeds) for arm in names
            if args.arms or workers < SLOW_AT.get(arm, 10**9)]


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"runs": [], "launches": []}


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train every planned run the JSON lacks, saving after each."""
    import dataclasses

    import torch

    from benchmarks.common.simulated import ARM, Setting, train_simulated
    from benchmarks.common.tasks import TASKS, evaluate, load

    torch.set_num_threads(1)
    task = TASKS["mnist1d"]
    build, train, test = load(task, args.quick)
    setting = Setting(epochs=1, global_batch=64) if args.quick else Setting()
    path = args.results / f"{NAME}.json"
    data = _load(path)
    described = json.loads(json.dumps(dataclasses.asdict(setting)))  # as the JSON holds it (lists, not tuples)
    if data.get("setting", described) != described:
        raise ValueError(f"{path} holds runs of another setting; move it away to start afresh")
    data.update(setting=described, task="mnist1d", data=[len(train[1]), len(test[1])])
    done = {(r["arm"], r["workers"], r["seed"]) for r in data["runs"]}
    todo = [key for key in _planned(args) if key not in done]
    load_before, started = os.getloadavg(), time.perf_counter()
    for index, (arm, workers, seed) in enumerate(todo):
        record = train_simulated(ARM[arm], workers, seed, setting, build, train, test,
                                 lambda model, held: evaluate(task, model, held))
        data["runs"].append(record)
        _save(path, data)
        print(f"[{index + 1}/{len(todo)}] {arm} W={workers} seed {seed}: accuracy {record['final']:.4f}, volume "
              f"{record['volume']:.4f}, {record['wall_s']:.0f} s", flush=True)
    if todo:
        data["launches"].append(
            f"{len(todo)} runs on {machine()}; load average (1, 5, 15 min) "
            f"{', '.join(f'{x:.1f}' for x in load_before)} before and "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} after; {(time.perf_counter() - started) / 60:.1f} min")
        _save(path, data)
    return data


def main() -> None:
    from benchmarks.common.many_workers_report import write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help=f"default {' '.join(map(str, WORKERS))}")
    parser.add_argument("--arms", nargs="+", default=None, help="arm names as in the report (default: all)")
    parser.add_argument("--seeds", type=int, default=None, help=f"default {SEEDS} ({QUICK_SEEDS} with --quick)")
    parser.add_argument("--report", action="store_true", help="only write the report again, from the JSON")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.workers = args.workers or list(QUICK_WORKERS if args.quick else WORKERS)
    args.seeds = args.seeds or (QUICK_SEEDS if args.quick else SEEDS)
    data = _load(args.results / f"{NAME}.json") if args.report else run(args)
    write_report(data, args.results, NAME, two_phase_from=min(SLOW_AT.values()))


if __name__ == "__main__":
    main()
