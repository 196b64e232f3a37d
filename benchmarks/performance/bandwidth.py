"""Bandwidth-limited training step: dense allreduce vs Top-k vs LEGACY at 1 Gbit/s to 10 Mbit/s.

    python -m benchmarks.performance.bandwidth            # the full run (about 15 minutes here)
    python -m benchmarks.performance.bandwidth --quick    # a smoke run with tiny models

Needs root: four Horovod workers run over Gloo TCP, each in its own Linux network namespace,
joined by veth links to a bridge whose ports are rate limited with ``tc`` token buckets in both
directions (:mod:`benchmarks.performance.netns`; the namespaces are made and removed here, and
traffic never leaves them). The rate is changed between phases while the workers keep running.

Each worker trains the same two models (:mod:`benchmarks.performance.step_models`, about 11M
parameters each, on fixed synthetic batches) four ways, side by side and interleaved step by
step: *compute only* (forward, backward and SGD with no communication: the compute time of the
lower bound), *dense* (Horovod's own allreduce, ``hvd.Compression.none``), *Top-k* (uniform
density 0.001 with error feedback, ``Grace(TopK(0.001), memory=Residual())``) and *LEGACY*
(``Legacy.budget_matched(TopK(), 0.001, by="layer", ...)``: the reference's layer-wise shape,
small tensors denser, scaled to send the same bytes as Top-k, also with error feedback).

A step is timed from forward to the end of ``optimizer.step()`` (which waits for the gradients),
on every rank after a barrier; the slowest rank's time counts. Wire bytes are read from the
worker's interface counters around the step (Ethernet frames: payload, TCP/IP headers, Horovod's
own coordination): the larger of sent and received, the slowest link's. The lower bound of a way
at rate ``B`` is ``compute time + wire bytes / B``: what the step would take if communication
cost nothing but the bytes on a saturated link and nothing overlapped with compute.
Results: ``benchmarks/results/performance.md`` (section "bandwidth"), ``bandwidth.json`` and
``bandwidth.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKERS = 4
DENSITY = 0.001
# LEGACY's shape, the reference's layer example (``--group_compressions 100,1,0.1
# --group_splits 10000,1000000``): tensors under 10k elements 1000x the density of those over 1M,
# those in between 10x; budget_matched scales it to Top-k's bytes.
LEGACY_SPLITS = [10_000, 1_000_000]
LEGACY_FACTORS = [1000.0, 10.0, 1.0]
RATES = [1e9, 1e8, 1e7]
QUICK_RATES = [1e9, 1e8]
WAYS = ("compute only", "dense", "Top-k", "LEGACY")
# A way whose dense communication alone would take longer than this gets fewer steps and no
# warm-up at that rate (it has warmed up at the faster rates before): 10 Mbit/s costs a minute a step.
SLOW_STEP_S = 10.0
LEARNING_RATE = 1e-3


def label(rate: float) -> str:
    return f"{rate / 1e9:g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s"


# -- the workers ---------------------------------------------------------------------------------------

@dataclass
class Way:
    name: str
    step_model: Any
    optimizer: Any
    compression: Any = None
    dense_bytes: int = 0

    def step(self) -> None:
        self.optimizer.zero_grad()
        self.step_model.loss().backward()
        self.optimizer.step()

    def payload_bytes(self) -> int:
        """Bytes this rank has handed to collectives so far (grace_legacy's count; Horovod keeps none)."""
        return self.compression.stats["bytes_sent"] if hasattr(self.compression, "stats") else 0


def build_way(name: str, model: str, quick: bool, hvd: Any) -> Way:
    import torch

    from benchmarks.performance.step_models import build
    from grace_legacy import Grace, Legacy, Residual, TopK

    step_model = build(model, quick, seed=0, data_seed=hvd.rank())
    optimizer = torch.optim.SGD(step_model.model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    if name == "compute only":
        return Way(name, step_model, optimizer)
    # Names unique per way: the ways' collectives must never be mistaken for one another.
    named = [(f"{model}.{name}.{n}", p) for n, p in step_model.model.named_parameters()]
    if name == "dense":
        compression = hvd.Compression.none
    elif name == "Top-k":
        compression = Grace(TopK(DENSITY), memory=Residual())
    else:
        schedule = Legacy.budget_matched(TopK(), DENSITY, by="layer", sizes=named, splits=LEGACY_SPLITS,
                                         layer_factors=LEGACY_FACTORS, world_size=hvd.size())
        compression = Grace(schedule, memory=Residual())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
    hvd.broadcast_parameters(step_model.model.state_dict(), root_rank=0)
    return Way(name, step_model, optimizer, compression, sum(p.numel() * p.element_size() for _, p in named))


def interface_bytes() -> tuple[int, int]:
    """(sent, received) bytes of this namespace's link so far."""
    from benchmarks.performance.netns import IFACE

    base = Path("/sys/class/net") / IFACE / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (lets hvd.DistributedOptimizer take grace_legacy compression)
    from grace_legacy import TopK

    hvd.init()
    torch.set_num_threads(1)
    control = Path(args.control)
    barrier_flag = torch.zeros(1)

    def barrier() -> None:
        hvd.allreduce(barrier_flag, name="bandwidth.barrier")

    def set_rate(request: int, rate: float) -> None:
        # Rank 0 asks the driver (which owns the network) and waits; the others wait at the barrier.
        if hvd.rank() == 0:
            (control / f"request-{request}.tmp").write_text(repr(rate))
            (control / f"request-{request}.tmp").rename(control / f"request-{request}")
            while not (control / f"applied-{request}").exists():
                time.sleep(0.05)
        barrier()

    def timed_step(way: Way) -> tuple[float, float, int]:
        barrier()
        payload_before = way.payload_bytes()
        sent_before, received_before = interface_bytes()
        start = time.perf_counter()
        way.step()
        elapsed = time.perf_counter() - start
        sent, received = interface_bytes()
        wire = max(sent - sent_before, received - received_before)
        slowest = hvd.allreduce(torch.tensor([elapsed, float(wire)], dtype=torch.float64),
                                name="bandwidth.slowest", op=hvd.Max)
        payload = way.dense_bytes if way.name == "dense" else way.payload_bytes() - payload_before
        return slowest[0].item(), slowest[1].item(), payload

    results: dict[str, Any] = {"workers": hvd.size(), "density": DENSITY, "models": {}}
    request = 0
    for model in args.models:
        ways = {name: build_way(name, model, args.quick, hvd) for name in WAYS}
        parameters = [p for p in ways["compute only"].step_model.model.parameters()]
        numel = sum(p.numel() for p in parameters)
        dense_wire = 2 * (hvd.size() - 1) / hvd.size() * 4 * numel
        record: dict[str, Any] = {
            "parameters": numel, "tensors": len(parameters), "dense_ring_bytes": dense_wire,
            "legacy": repr(ways["LEGACY"].compression.compressor), "rates": {}}
        for phase, rate in enumerate(args.rates):
            set_rate(request, rate)
            request += 1
            plan = {}
            for name in WAYS:
                slow = name == "dense" and dense_wire * 8 / rate > SLOW_STEP_S
                warmup = 0 if slow and phase > 0 else args.warmup
                plan[name] = (warmup, args.slow_steps if slow else args.steps)
            measured = {name: {"step_s": [], "wire_bytes": [], "payload_bytes": []} for name in WAYS}
            for iteration in range(max(w + s for w, s in plan.values())):
                # Rotated each iteration so that no way always follows the same one.
                order = WAYS[iteration % len(WAYS):] + WAYS[:iteration % len(WAYS)]
                for name in order:
                    warmup, steps = plan[name]
                    if iteration >= warmup + steps:
                        continue
                    step_s, wire, payload = timed_step(ways[name])
                    if iteration >= warmup:
                        measured[name]["step_s"].append(step_s)
                        measured[name]["wire_bytes"].append(wire)
                        measured[name]["payload_bytes"].append(payload)
            record["rates"][repr(rate)] = measured
            if hvd.rank() == 0:
                print(f"{model} at {label(rate)}: " + ", ".join(
                    f"{n} {statistics.median(m['step_s']):.3f} s" for n, m in measured.items()), flush=True)
        # What Top-k's selection alone costs on this model's gradients, all ranks at once (as in a step).
        topk, grads = TopK(DENSITY), [torch.randn_like(p) for p in parameters]
        selection = []
        for _ in range(3):
            barrier()
            start = time.perf_counter()
            for index, grad in enumerate(grads):
                topk.compress(grad, str(index))
            selection.append(time.perf_counter() - start)
        record["topk_compress_s"] = statistics.median(selection)
        results["models"][model] = record
        del ways, parameters, grads
        gc.collect()
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps(results))


# -- the driver ----------------------------------------------------------------------------------------

def serve_rate_requests(cluster: Any, control: Path) -> None:
    """Apply every rate a worker has asked for since the last call."""
    for request in sorted(control.glob("request-[0-9]*"), key=lambda p: int(p.name.split("-")[1])):
        applied = control / f"applied-{request.name.split('-')[1]}"
        if not applied.exists():
            cluster.set_rate(float(request.read_text()))
            applied.touch()


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.performance.netns import Cluster, HorovodJob, unavailable_reason
    from benchmarks.report import machine

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bandwidth benchmark: {reason}")
    with tempfile.TemporaryDirectory() as tmp, Cluster(WORKERS) as cluster:
        control = Path(tmp) / "control"
        control.mkdir()
        out = Path(tmp) / "bandwidth.json"
        argv = [sys.executable, "-m", "benchmarks.performance.bandwidth", "--worker", "--control", str(control),
                "--json", str(out), "--models", *args.models, "--rates", *map(repr, args.rates),
                "--steps", str(args.steps), "--slow-steps", str(args.slow_steps), "--warmup", str(args.warmup)]
        if args.quick:
            argv.append("--quick")
        env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               # A 44 MB allreduce at 10 Mbit/s takes a minute: longer than Gloo's and Horovod's patience.
               "HOROVOD_GLOO_TIMEOUT_SECONDS": "900", "HOROVOD_STALL_CHECK_DISABLE": "1"}
        with HorovodJob(cluster, argv, Path(tmp) / "logs", env=env, cwd=REPO) as job:
            job.wait(args.timeout, poll=lambda: serve_rate_requests(cluster, control))
            print(job.tail(0, chars=2000))
        result = json.loads(out.read_text())
    result["machine"] = machine()
    return result


def summarise(result: dict) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Per model, rate and way: median step time, wire bytes, the lower bound and the ratios."""
    table: dict[str, Any] = {}
    for model, record in result["models"].items():
        table[model] = {}
        for rate_key, ways in record["rates"].items():
            rate = float(rate_key)
            compute = statistics.median(ways["compute only"]["step_s"])
            dense = statistics.median(ways["dense"]["step_s"])
            rows = {}
            for name, measured in ways.items():
                step = statistics.median(measured["step_s"])
                wire = statistics.median(measured["wire_bytes"])
                bound = compute + wire * 8 / rate
                rows[name] = {"step_s": step, "wire_bytes": wire, "bound_s": bound, "vs_bound": step / bound,
                              "speedup_vs_dense": dense / step,
                              "payload_bytes": statistics.median(measured["payload_bytes"]),
                              "steps": len(measured["step_s"])}
            table[model][rate_key] = rows
    return table


def write(result: dict, results_dir: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import update_section

    table = summarise(result)
    result = {**result, "summary": table}
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "bandwidth.json").write_text(json.dumps(result, indent=1))
    rows, verdicts = [], []
    for model, rates in table.items():
        record = result["models"][model]
        for rate_key, ways in rates.items():
            for name, row in ways.items():
                wire = "-" if name == "compute only" else f"{row['wire_bytes'] / 1e6:.3f}"
                rows.append(f"| {model} | {label(float(rate_key))} | {name} | {row['step_s']:.3f} | {wire} | "
                            f"{row['bound_s']:.3f} | {row['vs_bound']:.2f} | {row['speedup_vs_dense']:.2f}x | "
                            f"{row['steps']} |")
        at_100 = rates.get(repr(1e8))
        if at_100:
            topk = at_100["Top-k"]
            speedup_ok, bound_ok = topk["speedup_vs_dense"] >= 5, topk["vs_bound"] <= 1.5
            verdicts.append(
                f"- {model} ({record['parameters'] / 1e6:.1f}M parameters, {record['tensors']} tensors) at 100 Mbit/s: "
                f"Top-k {DENSITY} + EF steps in {topk['step_s']:.3f} s vs dense {at_100['dense']['step_s']:.3f} s, "
                f"**{topk['speedup_vs_dense']:.1f}x** faster ({'meets' if speedup_ok else 'misses'} the 5x target), "
                f"**{topk['vs_bound']:.2f}x** its lower bound of {topk['bound_s']:.3f} s "
                f"({'meets' if bound_ok else 'misses'} the 1.5x target); LEGACY at the same volume "
                f"{at_100['LEGACY']['step_s']:.3f} s ({at_100['LEGACY']['speedup_vs_dense']:.1f}x, "
                f"{at_100['LEGACY']['vs_bound']:.2f}x its bound). Top-k's selection alone takes "
                f"{record['topk_compress_s']:.3f} s per step on this model, compute "
                f"{at_100['compute only']['step_s']:.3f} s.")
    schedules = "\n".join(f"- {model}: `{record['legacy']}`" for model, record in result["models"].items())
    text = f"""## Bandwidth-limited training step

`{command}`

Machine: {result['machine']}. {result['workers']} Horovod workers over Gloo TCP, each in its own
network namespace, on veth links to a bridge rate limited in both directions with `tc tbf` (a
full-duplex link of the given rate per worker). All four workers share this machine's CPU cores,
so the compute part is slower than on four separate hosts. Per model, rate and way: the median
over interleaved steps of the slowest rank's step time (forward, backward, communication,
optimizer). *Wire* is the median of the slowest link's bytes (Ethernet frames, the larger of
sent and received) per step; the lower bound is `compute only + wire / rate`; *vs bound* is
step time / lower bound; *vs dense* is dense's step time / this way's.

Ways: dense = Horovod's allreduce (`hvd.Compression.none`); Top-k = `Grace(TopK({DENSITY}),
memory=Residual())`; LEGACY = `Legacy.budget_matched(TopK(), {DENSITY}, by="layer",
splits={LEGACY_SPLITS}, layer_factors={[int(f) for f in LEGACY_FACTORS]})` with `Residual()`,
which sends as many bytes as Top-k:
{schedules}

| model | rate | way | step s | wire MB / step | lower bound s | vs bound | vs dense | steps |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{chr(10).join(verdicts)}

![step time vs bandwidth](bandwidth.png)
"""
    update_section(results_dir / "performance.md", "bandwidth", text, title="Performance results")

    colours = {"dense": "#c44", "Top-k": "#36b", "LEGACY": "#2a2"}
    figure, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4.2), squeeze=False)
    for axis, (model, rates) in zip(axes[0], table.items(), strict=True):
        xs = sorted(float(r) for r in rates)
        rows_at = [rates[repr(x)] for x in xs]
        axis.plot(xs, [r["compute only"]["step_s"] for r in rows_at], ":", color="#777", label="compute only")
        for name, colour in colours.items():
            axis.plot(xs, [r[name]["step_s"] for r in rows_at], "o-", color=colour, label=f"{name}")
            axis.plot(xs, [r[name]["bound_s"] for r in rows_at], "--", color=colour, alpha=0.6,
                      label=f"{name} lower bound")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xticks(xs, [label(x) for x in xs])
        axis.set_xlabel("link rate per worker")
        axis.set_ylabel("training step time (s, median)")
        parameters = result["models"][model]["parameters"]
        axis.set_title(f"{model}, {parameters / 1e6:.1f}M parameters, {result['workers']} workers")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(results_dir / "bandwidth.png", dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, two rates, two steps: a smoke run")
    parser.add_argument("--models", nargs="+", default=["resnet", "transformer"])
    parser.add_argument("--rates", nargs="+", type=float, default=None, help="link rates in bit/s")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per way and rate")
    parser.add_argument("--slow-steps", type=int, default=2, help=f"timed steps where dense takes > {SLOW_STEP_S} s")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the workers are stopped")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rates is None:
        args.rates = QUICK_RATES if args.quick else RATES
    if args.steps is None:
        args.steps = 2 if args.quick else 8
    if args.timeout is None:
        args.timeout = 600 if args.quick else 3600
    if args.worker:
        worker(args)
        return
    # SIGTERM and SIGHUP unwind like Ctrl-C, so the namespaces and workers are always removed.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, frame: sys.exit(128 + number))
    result = launch(args)
    command = "python -m benchmarks.performance.bandwidth" + (" --quick" if args.quick else "")
    write(result, args.results, command)
    print(json.dumps({model: {label(float(r)): {n: round(w["step_s"], 3) for n, w in ways.items()}
                              for r, ways in rates.items()} for model, rates in summarise(result).items()}, indent=1))


if __name__ == "__main__":
    main()
