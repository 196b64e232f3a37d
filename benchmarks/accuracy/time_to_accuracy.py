"""Time to accuracy: how much sooner does a user reach the dense run's accuracy?

    python -m benchmarks.accuracy.time_to_accuracy                  # one part (at most --max-minutes); rerun to go on
    python -m benchmarks.accuracy.time_to_accuracy --report-only    # the report from what is measured so far
    python -m benchmarks.accuracy.time_to_accuracy --quick          # a smoke run: 2 workers, tiny model, 3 arms

Needs root: real workers, each in its own Linux network namespace on links rate limited with
``tc`` (:mod:`benchmarks.common.netns`), Horovod's under its Gloo launcher
(:class:`~benchmarks.common.netns.HorovodJob`) and DDP's as ``torchrun`` starts them
(:class:`~benchmarks.common.netns.TorchJob`). The task and the arms are in
:mod:`benchmarks.common.time_to_accuracy_arms` (mnist1d with a wide MLP: little compute per
step, about a million parameters), the workers in :mod:`benchmarks.common.time_to_accuracy_worker`.

The measurement is split into launches, one per framework, worker count, link rate and seed (so a
stopped measurement has every arm of its first seeds rather than one framework's). The first launch
of a framework, worker count and rate times every arm's step side by side; each then trains its
(arm, seed) runs, each for ``--epochs`` at a constant rate, evaluating every ``--eval-epochs``.
Rank 0 appends each finished run to ``time_to_accuracy.json`` under ``--results``; a rerun of the
same command skips what is there, and no run is started that the launch's own step timing says
would end past ``--max-minutes`` after the command started. So the full measurement runs in parts
of at most that long (default 40 minutes; a run is capped at ``--run-cap-minutes``), each writing
the report from everything measured so far; the last line printed says how much is left. A results
file holds one set-up: other ``--epochs``, ``--eval-epochs`` or ``--quick`` need another
``--results`` folder. Each part, run and step timing records the commit its code was at;
``--redo-other-code`` sets aside (under ``superseded`` in the JSON) the runs and step timings of
the plan (as ``--workers``, ``--rates`` and ``--arms`` select it) made with other code than the
committed tree's now, and measures them again, part by part as before (a step timing only where
every arm it timed is selected, so that no other arm loses its timed step); ``--retime-other-code``
does so for the step timings alone, the runs left as they are. "Other code" is a commit whose
measuring code (:data:`MEASURING`: the library, the workers, this driver) differs from now's.

Where runs are real (``--real``: worker count @ rate), the time to target is the clock of real runs;
at the other launches (``--workers`` x ``--rates``) only the steps are timed, and the time to target
is projected: each real run's steps to target, at the same worker count, times the median step
there. The projection is validated at the launches that have both. The default plan: all arms at 8
workers, the main arms at 16; real runs at 8 workers at both rates and at 16 workers at 1 Gbit/s,
16 workers at 100 Mbit/s projected, and a step timing at 10 Gbit/s (faster than the workers can fill:
each arm's step where the link is no limit, the planner check's floor; no time to target there).
On a quiet 2-core machine its dense-class runs at 100 Mbit/s take several minutes each (about 600
steps at the link's time for 8 MB), the whole plan some five hours: about eight parts. The report
(:mod:`benchmarks.common.time_to_accuracy_report`) is ``time_to_accuracy.md`` and ``.png`` under
``--results``, its summary in the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.limited_link import COMPUTE
from benchmarks.common.time_to_accuracy_analysis import FLOOR_RATE
from benchmarks.common.time_to_accuracy_arms import (
    ARM_LIST,
    GLOBAL_BATCH,
    HOROVOD,
    LR,
    MOMENTUM,
    QUICK_ARMS,
    QUICK_WIDTHS,
    WIDTHS,
)
from benchmarks.common.time_to_accuracy_worker import load_results, run_key, run_launch, timing_key

MODULE = "benchmarks.accuracy.time_to_accuracy"
REPO = Path(__file__).resolve().parents[2]
#: What a run's or a step timing's figures depend on (git pathspecs): the library, the workers,
#: their arms and links, this driver; not the statistics or the report drawn from them.
MEASURING = ("grace_legacy", "benchmarks/common", "benchmarks/accuracy/time_to_accuracy.py",
             ":(exclude)benchmarks/common/time_to_accuracy_analysis.py",
             ":(exclude)benchmarks/common/time_to_accuracy_report.py")
RESULTS = REPO / "benchmarks" / "results"
NAME = "time_to_accuracy"
#: What a launch needs besides its runs (starting the workers, the step timing): none is begun
#: with less time left in the part.
LAUNCH_S = 180
QUICK_GLOBAL_BATCH = 64
#: The options that change what a run measures: a results file holds runs of one set-up only.
SETUP_KEYS = ("quick", "widths", "global_batch", "lr", "momentum", "epochs", "eval_epochs", "run_cap_s")


@dataclass(frozen=True)
class Launch:
    """One launch: a framework at a worker count and link rate, its arms, the seeds of its runs
    (none where the runs at this worker count and rate are projected, not real)."""

    framework: str
    workers: int
    rate: float
    arms: tuple[str, ...]
    seeds: tuple[int, ...]

    @property
    def label(self) -> str:
        seeds = f", seed {', '.join(map(str, self.seeds))}" if self.seeds else ", step timing only"
        return f"{self.framework}, {self.workers} workers, {self.rate / 1e6:g} Mbit/s{seeds}"


def config(text: str) -> tuple[int, float]:
    """``WORKERS@RATE`` (e.g. ``8@1e8``) as ``(8, 1e8)``."""
    try:
        workers, rate = text.split("@")
        return int(workers), float(rate)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be WORKERS@RATE in bit/s, e.g. 8@1e8, got {text!r}") from None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 workers, tiny model, 3 arms, 1 seed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3; 1 with --quick)")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default 8 16)")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="link rates in bit/s (default 1e8 1e9 1e10: the last, step timing only, the planner "
                             "check's floor)")
    parser.add_argument("--real", type=config, nargs="*", default=None,
                        help="WORKERS@RATE where the runs are real (default 8@1e8 8@1e9 16@1e9); at the others "
                             "only the steps are timed and the time to target is projected")
    parser.add_argument("--all-arms-up-to", type=int, default=8,
                        help="above this many workers only the main arms run (default 8)")
    parser.add_argument("--arms", nargs="+", default=None, help="only these arms (names as in the report)")
    parser.add_argument("--epochs", type=float, default=None, help="each run's budget in epochs (default 40)")
    parser.add_argument("--eval-epochs", type=float, default=None, help="epochs between evaluations (default 1)")
    parser.add_argument("--margin", type=float, default=1.0,
                        help="the target: the dense fp32 runs' final accuracy less this many points (default 1)")
    parser.add_argument("--max-minutes", type=float, default=40.0, help="the longest a part runs (default 40)")
    parser.add_argument("--run-cap-minutes", type=float, default=20.0, help="a run's clock stops it here")
    parser.add_argument("--timing-bursts", type=int, default=None,
                        help="timed bursts of --timing-burst steps per arm (default 10; 3 with --quick)")
    parser.add_argument("--timing-burst", type=int, default=None, help="consecutive steps a burst (default 5; 2 "
                                                                        "with --quick)")
    parser.add_argument("--timing-warmup", type=int, default=1, help="untimed bursts per arm first (default 1)")
    parser.add_argument("--report-only", action="store_true", help="write the report from the JSON, launch nothing")
    parser.add_argument("--retime-other-code", action="store_true",
                        help="time again the selected launches' steps where they were timed with other code than "
                             "the committed tree's now, the runs left as they are (the earlier timing is kept "
                             "under 'superseded'; only where every arm it timed is selected)")
    parser.add_argument("--redo-other-code", action="store_true",
                        help="measure again the selected runs and step timings made with other code than the "
                             "committed tree's now (the earlier records are kept under 'superseded'; a step "
                             "timing only where every arm it timed is selected)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    for name, full, small in (("seeds", 3, 1), ("workers", [8, 16], [2]), ("rates", [1e8, 1e9, FLOOR_RATE], [1e8]),
                              ("real", [(8, 1e8), (8, 1e9), (16, 1e9)], [(2, 1e8)]), ("epochs", 40.0, 2.0),
                              ("eval_epochs", 1.0, 0.5), ("timing_bursts", 10, 3), ("timing_burst", 5, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.arms is None:
        args.arms = list(QUICK_ARMS) if quick else [arm.name for arm in ARM_LIST]
    unknown = sorted(set(args.arms) - {arm.name for arm in ARM_LIST})
    if unknown:
        parser.error(f"--arms: no arm named {', '.join(map(repr, unknown))}")
    if args.timing_warmup * args.timing_burst < 2:
        parser.error("--timing-warmup x --timing-burst must be at least 2 (PyTorch's PowerSGD hook compresses from "
                     "its third step)")
    if args.seeds < 1 or args.epochs <= 0 or args.eval_epochs <= 0 or args.max_minutes <= 0:
        parser.error("--seeds, --epochs, --eval-epochs and --max-minutes must be positive")
    return args


def setup_of(args: argparse.Namespace) -> dict[str, Any]:
    """What every run of this results file shares (:data:`SETUP_KEYS`), and the step timing's options."""
    return {"quick": args.quick, "widths": list(QUICK_WIDTHS if args.quick else WIDTHS),
            "global_batch": QUICK_GLOBAL_BATCH if args.quick else GLOBAL_BATCH, "lr": LR, "momentum": MOMENTUM,
            "epochs": args.epochs, "eval_epochs": args.eval_epochs, "run_cap_s": 60 * args.run_cap_minutes,
            "timing_bursts": args.timing_bursts, "timing_burst": args.timing_burst,
            "timing_warmup": args.timing_warmup}


def launches(args: argparse.Namespace) -> list[Launch]:
    """Every launch in order: worker count by worker count, rate by rate, seed by seed, Horovod then
    DDP; so a stopped measurement has every arm of its first seeds rather than one framework's.
    Where the runs are projected, one launch per framework that only times the steps."""
    out = []
    for workers in args.workers:
        for rate in args.rates:
            real = (workers, rate) in args.real
            for seed in range(args.seeds) if real else [None]:
                for framework in (HOROVOD, "ddp"):
                    arms = tuple(arm.name for arm in ARM_LIST if arm.framework == framework and arm.name in args.arms
                                 and (arm.main or workers <= args.all_arms_up_to))
                    if arms:
                        out.append(Launch(framework, workers, rate, arms, () if seed is None else (seed,)))
    return out


def pending(launch: Launch, results: dict[str, Any]) -> tuple[bool, list[tuple[str, int]]]:
    """Whether ``launch``'s steps are still to be timed (no timing of every one of its arms), and
    its runs still to be made."""
    done = {run["key"] for run in results["runs"]}
    key = timing_key(launch.framework, launch.workers, launch.rate)
    timed = [set(timing["ways"]) for timing in results["timings"] if timing["key"] == key]
    runs = [(arm, seed) for seed in launch.seeds for arm in launch.arms
            if run_key(launch.framework, launch.workers, launch.rate, arm, seed) not in done]
    return not any(set(launch.arms) <= ways for ways in timed), runs


def check_setup(path: Path, results: dict[str, Any], setup: dict[str, Any]) -> None:
    """Refuse to add runs of another set-up to a results file (resuming must not mix them)."""
    earlier = results.get("setup")
    if earlier is None:
        return
    changed = [key for key in SETUP_KEYS if earlier.get(key) != setup[key]]
    if changed:
        differences = ", ".join(f"{key}: {earlier.get(key)!r}, now {setup[key]!r}" for key in changed)
        raise SystemExit(f"{path} holds runs of another set-up ({differences}); use another --results folder, "
                         f"or remove the file to start again")


def same_code(recorded: str | None, code: str, repo: Path = REPO) -> bool:
    """Whether a record made at commit ``recorded`` measured what commit ``code`` would: the same
    commit, or commits whose :data:`MEASURING` files do not differ (a commit of the report's code or
    of the results changes nothing measured). Unknown, uncommitted or missing commits: no."""
    if not recorded or recorded == "unknown" or recorded.endswith("-dirty"):
        return False
    if recorded == code:
        return True
    diff = subprocess.run(["git", "diff", "--quiet", recorded, code, "--", *MEASURING], cwd=repo,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return diff.returncode == 0


def supersede_other_code(args: argparse.Namespace, path: Path, code: str,
                         kinds: tuple[str, ...] = ("runs", "timings")) -> int:
    """Move the runs and step timings of ``args``'s launches made with other code than ``code``
    (or with none recorded) to the results' ``superseded`` list, each marked with the code that
    replaces it; they are then pending again (``kinds``: which of them). A step timing goes only
    where every arm it timed is selected: timed again with fewer arms, the others would lose their
    timed step. Returns how many were moved. Records made with ``code`` (:func:`same_code`) stay,
    so the same command run again goes on where it stopped."""
    results = load_results(path)
    plan = launches(args)
    selected = {run_key(launch.framework, launch.workers, launch.rate, arm, seed)
                for launch in plan for arm in launch.arms for seed in launch.seeds}
    arms = {timing_key(launch.framework, launch.workers, launch.rate): set(launch.arms) for launch in plan}
    selected |= {timing["key"] for timing in results["timings"] if timing["key"] in arms
                 and set(timing["ways"]) - {COMPUTE} <= arms[timing["key"]]}
    moved = [(kind, record) for kind in kinds for record in results[kind]
             if record["key"] in selected and not same_code(record.get("code"), code)]
    if moved:
        for kind, record in moved:
            results[kind].remove(record)
        results.setdefault("superseded", []).extend({**record, "kind": kind, "superseded_by": code}
                                                    for kind, record in moved)
        path.write_text(json.dumps(results, indent=1))
    return len(moved)


def run_one_launch(launch: Launch, runs: list[tuple[str, int]], timing: bool, setup: dict[str, Any], path: Path,
                   deadline: float, code: str) -> None:
    """Start ``launch``'s workers on a fresh cluster at its rate and wait for them."""
    from benchmarks.common.netns import Cluster, HorovodJob, TorchJob

    spec = {"framework": launch.framework, "rate": launch.rate, "arms": list(launch.arms), "timing": timing,
            "runs": runs, "deadline": deadline, "results": str(path.resolve()), "setup": setup, "code": code}
    # A 4 MB allreduce at 100 Mbit/s among 16 takes seconds: beyond neither Gloo's patience nor Horovod's.
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "900",
           "HOROVOD_STALL_CHECK_DISABLE": "1"}
    with tempfile.TemporaryDirectory() as tmp, Cluster(launch.workers) as cluster:
        cluster.set_rate(launch.rate)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        argv = [sys.executable, "-m", MODULE, "--worker", "--spec", str(spec_path)]
        job_class = HorovodJob if launch.framework == HOROVOD else TorchJob
        with job_class(cluster, argv, Path(tmp) / "logs", env=env, cwd=REPO) as job:
            job.wait(max(0.0, deadline - time.time()) + setup["run_cap_s"] * 1.5 + LAUNCH_S)
            print(job.tail(0, chars=1500), flush=True)


def run_part(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Launch what is left, in order, until the part's time is up; the part's record."""
    from benchmarks.common.netns import unavailable_reason
    from benchmarks.common.report import code_version, machine

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"{MODULE}: {reason}")
    started = time.time()
    deadline = started + 60 * args.max_minutes
    part = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
            "code": code_version(),
            "command": " ".join(["python -m", MODULE, *sys.argv[1:]]), "load_before": os.getloadavg()[0],
            "launches": []}
    setup = setup_of(args)
    if args.redo_other_code or args.retime_other_code:
        if part["code"] == "unknown" or part["code"].endswith("-dirty"):
            flag = "--redo-other-code" if args.redo_other_code else "--retime-other-code"
            raise SystemExit(f"{MODULE}: {flag} needs a committed tree (the code is {part['code']!r}): "
                             f"commit first, so that the new records name the code they measured")
        kinds = ("runs", "timings") if args.redo_other_code else ("timings",)
        part["superseded"] = supersede_other_code(args, path, part["code"], kinds)
    for launch in launches(args):
        results = load_results(path)
        timing, runs = pending(launch, results)
        if not timing and not runs:
            continue
        if deadline - time.time() < LAUNCH_S:
            print(f"part's time is up before {launch.label}: rerun the same command to go on", flush=True)
            break
        before = len(results["runs"])
        print(f"{launch.label}: {'timing, ' if timing else ''}{len(runs)} runs to make", flush=True)
        run_one_launch(launch, runs, timing, setup, path, deadline, part["code"])
        part["launches"].append({"launch": launch.label, "timed": timing,
                                 "runs": len(load_results(path)["runs"]) - before})
        if pending(launch, load_results(path))[1]:
            print(f"part's time is up within {launch.label}: rerun the same command to go on", flush=True)
            break
    part.update(load_after=os.getloadavg()[0], duration_s=time.time() - started)
    return part


def start_results(path: Path, args: argparse.Namespace) -> None:
    """The results file with this set-up, made if missing (refused if it holds another)."""
    results = load_results(path)
    setup = setup_of(args)
    check_setup(path, results, setup)
    if results["setup"] is None:
        results["setup"] = setup
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))


def left_to_do(args: argparse.Namespace, path: Path) -> int:
    """Step timings and runs of the plan not yet in the results file."""
    results = load_results(path)
    untimed, runs = set(), 0
    for launch in launches(args):
        timing, missing = pending(launch, results)
        if timing:
            untimed.add((launch.framework, launch.workers, launch.rate))
        runs += len(missing)
    return len(untimed) + runs


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        run_launch(spec)
        if spec["framework"] != HOROVOD:
            from benchmarks.common.worker_exit import end_worker

            end_worker()  # PyTorch's own DDP collectives can abort a finalizing interpreter
        return
    from benchmarks.common.time_to_accuracy_report import write_report

    path = args.results / f"{NAME}.json"
    start_results(path, args)
    if not args.report_only:
        for signum in (signal.SIGTERM, signal.SIGHUP):  # unwind (the namespaces are removed) as on Ctrl-C
            signal.signal(signum, lambda number, frame: sys.exit(128 + number))
        part = run_part(args, path)
        results = load_results(path)
        results["parts"].append(part)
        path.write_text(json.dumps(results, indent=1))
    left = left_to_do(args, path)
    summary = write_report(path, args.results, margin=args.margin,
                           plan={"launches": [vars(launch) for launch in launches(args)], "left": left,
                                 "seeds": args.seeds})
    print(json.dumps(summary["headline"], indent=1))
    print(f"{left} step timings and runs left" + (": rerun the same command to go on" if left else ""))


if __name__ == "__main__":
    main()
