"""What the bandwidth-limited step benchmarks share (:mod:`~benchmarks.performance.bandwidth` over
Horovod, :mod:`~benchmarks.performance.ddp_hooks` over ``torch.distributed``).

Both run their workers in the namespaces of :class:`~benchmarks.common.netns.Cluster` and
change the links' rate between phases while the workers keep running: rank 0 writes a request
into a control directory and waits until the driver, which owns the network, has applied it.
Within a phase the ways are interleaved step by step (the order rotated every iteration), and
each step is held to the lower bound of its own iteration: the compute-only step of the same
iteration plus the step's wire bytes at the rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The baseline every way is held to in the lower bound: forward, backward and SGD, no communication.
COMPUTE = "compute only"
# A way whose communication alone would take longer than LONG_STEP_S gets the "long" number of
# timed steps (its time is the link's, with little spread; the other ways keep theirs, whose spread
# is the shared cores'); longer than SLOW_STEP_S, it gets the "slow" number and no warm-up after
# the first phase (it has warmed up at the faster rate before).
LONG_STEP_S = 2.0
SLOW_STEP_S = 10.0
RATES = [1e9, 1e8, 1e7]
QUICK_RATES = [1e9, 1e8]
RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = RESULTS.parents[1]


def label(rate: float) -> str:
    return f"{rate / 1e9:g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s"


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """What a bandwidth-optimal allreduce of ``nbytes`` puts on each rank's link."""
    return 2 * (world_size - 1) / world_size * nbytes


def interface_bytes() -> tuple[int, int]:
    """(sent, received) bytes of this namespace's link so far."""
    from benchmarks.common.netns import IFACE

    base = Path("/sys/class/net") / IFACE / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


# -- changing the rate between phases --------------------------------------------------------------------

def timed_on_link(step: Callable[[], float]) -> tuple[float, float, int]:
    """Run ``step`` (which returns when its backward pass ended); returns its seconds, the seconds
    to the end of its backward pass, and the bytes this namespace's link carried meanwhile (the
    larger of sent and received)."""
    sent_before, received_before = interface_bytes()
    start = time.perf_counter()
    backward_done = step()
    elapsed = time.perf_counter() - start
    sent, received = interface_bytes()
    return elapsed, backward_done - start, max(sent - sent_before, received - received_before)


#: A rate request's file in the control folder, by number.
_REQUEST = re.compile(r"request-(\d+)")


def request_rate(control: Path, request: int, rate: float, is_root: bool, barrier: Callable[[], None]) -> None:
    """Worker side: rank 0 asks the driver for ``rate`` and waits until it is applied; every rank
    then meets at ``barrier``."""
    if is_root:
        # Written under another name, then renamed: the driver never reads a half-written rate.
        (control / f"writing-{request}").write_text(repr(rate))
        (control / f"writing-{request}").rename(control / f"request-{request}")
        while not (control / f"applied-{request}").exists():
            time.sleep(0.05)
    barrier()


def serve_rate_requests(cluster: Any, control: Path) -> None:
    """Driver side: apply every rate a worker has asked for since the last call."""
    numbers = sorted(int(match[1]) for path in control.iterdir() if (match := _REQUEST.fullmatch(path.name)))
    for number in numbers:
        applied = control / f"applied-{number}"
        if not applied.exists():
            cluster.set_rate(float((control / f"request-{number}").read_text()))
            applied.touch()


# -- one phase ---------------------------------------------------------------------------------------------

def plan_steps(link_seconds: Mapping[str, float], first_phase: bool, warmup: int, steps: int, long_steps: int,
               slow_steps: int) -> dict[str, tuple[int, int]]:
    """(warm-up, timed) steps per way, from the seconds its communication alone needs at this rate."""
    plan = {}
    for name, seconds in link_seconds.items():
        slow = seconds > SLOW_STEP_S
        plan[name] = (0 if slow and not first_phase else warmup,
                      slow_steps if slow else long_steps if seconds > LONG_STEP_S else steps)
    return plan


def interleave(plan: Mapping[str, tuple[int, int]], timed_step: Callable[[str], dict[str, float]]
               ) -> dict[str, dict[str, list[float]]]:
    """Run every way's steps, one of each way per iteration, the order rotated each iteration so that
    no way always follows the same one; returns each way's timed steps, with their iteration."""
    names = list(plan)
    measured: dict[str, dict[str, list[float]]] = {name: {"iteration": []} for name in names}
    for iteration in range(max(w + s for w, s in plan.values())):
        shift = iteration % len(names)
        for name in names[shift:] + names[:shift]:
            warmup, steps = plan[name]
            if iteration >= warmup + steps:
                continue
            timing = timed_step(name)
            if iteration >= warmup:
                measured[name]["iteration"].append(iteration)
                for key, value in timing.items():
                    measured[name].setdefault(key, []).append(value)
    return measured


# -- the statistics ----------------------------------------------------------------------------------------

def paired_vs_bound(measured: dict[str, list], compute: dict[str, list], rate: float) -> list[float]:
    """Each step's time over its own lower bound: the compute-only step of the same iteration plus
    the step's wire bytes at ``rate``. The ways of an iteration run back to back, so a slow spell
    of the shared cores stretches both sides of a ratio alike."""
    compute_at = dict(zip(compute["iteration"], compute["step_s"], strict=True))
    return [step / (compute_at[i] + wire * 8 / rate)
            for i, step, wire in zip(measured["iteration"], measured["step_s"], measured["wire_bytes"], strict=True)
            if i in compute_at]


def summarise(result: dict, baseline: str = "dense",
              extra: Sequence[str] = ("backward_s", "link_bytes", "payload_bytes")) -> dict[str, Any]:
    """Per model, rate and way: median step time, wire bytes, the lower bound, the ratios to it and
    the speed-up over ``baseline``; the median of each key of ``extra`` that was measured."""
    table: dict[str, Any] = {}
    for model, record in result["models"].items():
        table[model] = {}
        for rate_key, ways in record["rates"].items():
            rate = float(rate_key)
            compute = statistics.median(ways[COMPUTE]["step_s"])
            reference = statistics.median(ways[baseline]["step_s"])
            rows = {}
            for name, measured in ways.items():
                step = statistics.median(measured["step_s"])
                wire = statistics.median(measured["wire_bytes"])
                bound = compute + wire * 8 / rate
                # No iteration in common (a warm-up longer than a slow way's steps): the medians' ratio.
                ratios = paired_vs_bound(measured, ways[COMPUTE], rate) or [step / bound]
                quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                rows[name] = {"step_s": step, "wire_bytes": wire, "bound_s": bound,
                              "vs_bound": statistics.median(ratios),
                              "vs_bound_quartiles": [quartiles[0], quartiles[2]], "pairs": len(ratios),
                              f"speedup_vs_{baseline}": reference / step,
                              **{key: statistics.median(measured[key]) for key in extra if key in measured},
                              "step_s_range": [min(measured["step_s"]), max(measured["step_s"])],
                              "steps": len(measured["step_s"])}
            table[model][rate_key] = rows
    return table


def parser(doc: str | None, quick_help: str, long_way: str, slow_way: str) -> argparse.ArgumentParser:
    """The options both drivers take (``long_way``/``slow_way``: which ways get the long/slow step counts)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--models", nargs="+", default=["resnet", "transformer"])
    parser.add_argument("--rates", nargs="+", type=float, default=None, help="link rates in bit/s")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per way and rate")
    parser.add_argument("--dense-steps", type=int, default=None,
                        help=f"timed steps of {long_way} where its communication takes > {LONG_STEP_S:g} s")
    parser.add_argument("--slow-steps", type=int, default=2, help=f"timed steps of {slow_way} where it takes > "
                                                                  f"{SLOW_STEP_S:g} s")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the workers are stopped")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser, full_steps: int) -> argparse.Namespace:
    """The options, with the defaults that depend on ``--quick`` filled in."""
    args = parser.parse_args()
    if args.rates is None:
        args.rates = QUICK_RATES if args.quick else RATES
    if args.steps is None:
        args.steps = 2 if args.quick else full_steps
    if args.dense_steps is None:
        args.dense_steps = min(args.steps, 8)
    if args.timeout is None:
        args.timeout = 600 if args.quick else 3600
    return args


def drive(module: str, args: argparse.Namespace, launch: Callable[[argparse.Namespace], dict],
          write: Callable[[dict, Path, str], None], shown: Callable[[dict], Any]) -> None:
    """The driver's run: launch the workers (the namespaces are always removed: SIGTERM and SIGHUP
    unwind like Ctrl-C), write the report under the command that reproduces it, print ``shown``."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, frame: sys.exit(128 + number))
    result = launch(args)
    write(result, args.results, " ".join(["python -m", module, *reproducing_options(sys.argv[1:])]))
    print(json.dumps(shown(result), indent=1))


def reproducing_options(argv: Sequence[str]) -> list[str]:
    """The command-line options that shaped a run, for its report: all but ``--results`` (where
    the report went, a path of the machine that ran it)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--results":
            skip = True
        elif not arg.startswith("--results="):
            kept.append(arg)
    return kept


def launch_workers(module: str, args: argparse.Namespace, job_class: Any, workers: int, env: Mapping[str, str],
                   extra: Sequence[str] = ()) -> dict:
    """Run ``python -m MODULE --worker`` on ``workers`` ranks of a fresh :class:`Cluster` as
    ``job_class`` (:class:`~benchmarks.common.netns.HorovodJob` or ``TorchJob``) starts them,
    serving their rate requests; returns what rank 0 wrote, with the machine and its load."""
    from benchmarks.common.netns import Cluster, unavailable_reason
    from benchmarks.common.report import machine

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"{module}: {reason}")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, Cluster(workers) as cluster:
        control = Path(tmp) / "control"
        control.mkdir()
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", module, "--worker", "--control", str(control),
                "--json", str(out), "--models", *args.models, "--rates", *map(repr, args.rates),
                "--steps", str(args.steps), "--dense-steps", str(args.dense_steps),
                "--slow-steps", str(args.slow_steps), "--warmup", str(args.warmup), *extra]
        if args.quick:
            argv.append("--quick")
        environment = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
        with job_class(cluster, argv, Path(tmp) / "logs", env=environment, cwd=REPO) as job:
            job.wait(args.timeout, poll=lambda: serve_rate_requests(cluster, control))
            print(job.tail(0, chars=2000))
        result = json.loads(out.read_text())
    result["machine"] = machine()
    result["namespace_prefix"] = cluster.prefix
    # Other work on the machine slows the compute part (and the timings' spread): say how much there was.
    result["load_average"] = [load_before, os.getloadavg()[0]]
    result["duration_s"] = time.monotonic() - started
    return result


def plot_step_times(result: dict, table: dict, styles: Mapping[str, tuple[str, str]], path: Path, workers: str,
                    bounds: bool = False) -> None:
    """Step time against link rate, one panel a model: the compute-only line and each way of
    ``styles`` (way -> (colour, line style)), with its lower bound dashed if ``bounds``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4.2), squeeze=False)
    for axis, (model, rates) in zip(axes[0], table.items(), strict=True):
        xs = sorted(float(r) for r in rates)
        rows_at = [rates[repr(x)] for x in xs]
        axis.plot(xs, [r[COMPUTE]["step_s"] for r in rows_at], ":", color="#777", label=COMPUTE)
        for name, (colour, style) in styles.items():
            axis.plot(xs, [r[name]["step_s"] for r in rows_at], style, color=colour, label=name)
            if bounds:
                axis.plot(xs, [r[name]["bound_s"] for r in rows_at], "--", color=colour, alpha=0.6,
                          label=f"{name} lower bound")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(xs, [label(x) for x in xs])
        axis.set_xlabel("link rate per worker")
        axis.set_ylabel("training step time (s, median)")
        parameters = result["models"][model]["parameters"]
        axis.set_title(f"{model}, {parameters / 1e6:.1f}M parameters, {result['workers']} {workers}")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
