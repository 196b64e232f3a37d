"""Step time at 100 Mbit/s with 8 workers: ScatterGather QSGD(127) against dense allreduce.

    python -m benchmarks.performance.scatter_gather_step            # the full run (about 10 minutes)
    python -m benchmarks.performance.scatter_gather_step --quick    # a smoke run with a tiny model

Needs root: eight Horovod workers (``--workers``) run over Gloo TCP, each in its own Linux network
namespace, on veth links to a bridge rate limited in both directions with ``tc`` token buckets
(:mod:`benchmarks.common.netns`, :mod:`benchmarks.common.limited_link`).

Every worker trains the same MLP (:func:`benchmarks.common.step_models.build`, ``"mlp"``: 6.3M
parameters, 25 MB of gradients, little compute, so that the link sets the step) four ways,
interleaved step by step (the order rotated every iteration): *compute only* (forward, backward
and SGD, no communication: the compute of the lower bound), *dense* (Horovod's own allreduce),
*QSGD(127) scattergather* (``Grace(QSGD(127), communicator=ScatterGather())``, the route the
bundle takes by itself at 8 workers) and *QSGD(127) allgather* (``Grace(QSGD(127),
communicator=Allgather(), dense_fallback=False)``: the same payload gathered, which at 8 workers
puts as many bytes on each link as dense).

A step is timed from forward to the end of ``optimizer.step()`` on every rank after a barrier; the
slowest rank's time counts. Its lower bound is ``compute + wire / rate``: the compute-only step of
the same iteration, and the bytes its collectives need on the busiest rank's link with
bandwidth-optimal algorithms, counted at grace_legacy's backend
(:class:`~benchmarks.common.link_counters.CollectiveCounter`: the all-to-all's parts sent to the
other ranks, the gathered parts of the others, the inf/NaN flags' allreduce); for dense a ring
allreduce of the gradients. Each step is held to its own iteration's bound and the median of the
ratios is reported. Results: ``benchmarks/results/scatter_gather_step.md``, ``.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import limited_link
from benchmarks.common.limited_link import (
    COMPUTE,
    interleave,
    label,
    plan_steps,
    request_rate,
    summarise,
    timed_on_link,
)

WORKERS = 8
RATE = 1e8
DENSE = "dense"
SCATTER = "QSGD(127) scattergather"
GATHER = "QSGD(127) allgather"
WAYS = (COMPUTE, DENSE, SCATTER, GATHER)
#: ScatterGather QSGD(127)'s speed-up over dense at 100 Mbit/s and 8 workers, at least.
SPEEDUP_TARGET = 2.0
LEARNING_RATE = 1e-3


@dataclass
class Way:
    name: str
    step_model: Any
    optimizer: Any
    compression: Any = None

    def step(self) -> float:
        """One training step; returns when its backward pass ended."""
        self.optimizer.zero_grad()
        self.step_model.loss().backward()
        backward_done = time.perf_counter()
        self.optimizer.step()
        return backward_done


def build_way(name: str, model: str, quick: bool, hvd: Any) -> Way:
    import torch

    from benchmarks.common.step_models import build
    from grace_legacy import QSGD, Allgather, Grace, ScatterGather

    step_model = build(model, quick, seed=0, data_seed=hvd.rank())
    optimizer = torch.optim.SGD(step_model.model.parameters(), lr=LEARNING_RATE)
    if name == COMPUTE:
        return Way(name, step_model, optimizer)
    # Names unique per way: the ways' collectives are never mistaken for one another.
    named = [(f"{model}.{name}.{n}", p) for n, p in step_model.model.named_parameters()]
    if name == DENSE:
        compression = hvd.Compression.none
    elif name == SCATTER:
        compression = Grace(QSGD(127), communicator=ScatterGather())
    else:
        compression = Grace(QSGD(127), communicator=Allgather(), dense_fallback=False)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
    return Way(name, step_model, optimizer, compression)


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (lets hvd.DistributedOptimizer take grace_legacy compression)
    from benchmarks.common.link_counters import CollectiveCounter, ring_allreduce_bytes
    from grace_legacy.backends.horovod import HorovodBackend, synchronize

    hvd.init()
    torch.set_num_threads(1)
    counter = CollectiveCounter().install(HorovodBackend)
    control = Path(args.control)
    flag = torch.zeros(1)

    def barrier() -> None:  # waited for asleep, as grace_legacy waits
        synchronize(hvd.allreduce_async(flag, name="sg_step.barrier"))

    def over_ranks(values: list[float], name: str, op: Any) -> list[float]:
        return synchronize(hvd.allreduce_async(torch.tensor(values, dtype=torch.float64), name=name, op=op)).tolist()

    def timed_step(way: Way) -> dict[str, float]:
        barrier()
        counted = counter.total
        process_cpu = time.process_time()
        elapsed, backward, seen = timed_on_link(way.step)
        process_cpu = time.process_time() - process_cpu
        needed = dense_wire if way.name == DENSE else counter.total - counted
        slowest = over_ranks([elapsed, backward, float(seen), needed], "sg_step.slowest", hvd.Max)
        cpu = over_ranks([process_cpu], "sg_step.cpu", hvd.Average)
        return {"step_s": slowest[0], "backward_s": slowest[1], "link_bytes": slowest[2], "wire_bytes": slowest[3],
                "cpu_s": cpu[0]}

    results: dict[str, Any] = {"workers": hvd.size(), "models": {}}
    request = 0
    for model in args.models:
        ways = {name: build_way(name, model, args.quick, hvd) for name in WAYS}
        parameters = list(ways[COMPUTE].step_model.model.parameters())
        numel = sum(p.numel() for p in parameters)
        dense_wire = ring_allreduce_bytes(4 * numel, hvd.size())
        record: dict[str, Any] = {"parameters": numel, "tensors": len(parameters), "rates": {}}
        for phase, rate in enumerate(args.rates):
            request_rate(control, request, rate, hvd.rank() == 0, barrier)
            request += 1
            # The gathered way's link bytes are about dense's at 8 workers: it gets dense's step count.
            link_s = {name: dense_wire * 8 / rate if name in (DENSE, GATHER) else 0.0 for name in WAYS}
            plan = plan_steps(link_s, phase == 0, args.warmup, args.steps, args.dense_steps, args.slow_steps)
            measured = interleave(plan, lambda name, ways=ways: timed_step(ways[name]))
            record["rates"][repr(rate)] = measured
            record.setdefault("routes", {})[repr(rate)] = {
                name: way.compression.stats["tensors_by_route"] for name, way in ways.items()
                if hasattr(way.compression, "stats")}
            if hvd.rank() == 0:
                print(f"{model} at {label(rate)}: " + ", ".join(
                    f"{n} {statistics.median(m['step_s']):.3f} s" for n, m in measured.items()), flush=True)
        results["models"][model] = record
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps(results))


# -- the driver ------------------------------------------------------------------------------------

def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uptime unavailable"


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.netns import HorovodJob

    # A 44 MB allreduce at 100 Mbit/s takes several seconds: more patience than Gloo's default.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "900", "HOROVOD_STALL_CHECK_DISABLE": "1"}
    before = uptime()
    result = limited_link.launch_workers("benchmarks.performance.scatter_gather_step", args, HorovodJob,
                                         args.workers, env)
    result["uptime"] = [before, uptime()]
    result["cores"] = len(os.sched_getaffinity(0))
    return result


def cpu_clause(way: dict, compute: dict, result: dict) -> str:
    """Where a way's step goes beyond its bound: its CPU time beyond compute-only's, which the ranks
    share out over the cores (and with other jobs)."""
    cores = result.get("cores")
    if not cores:
        return ""
    extra = way["cpu_s"] - compute["cpu_s"]
    wall = extra * result["workers"] / cores
    return (f" Each rank's step takes {way['cpu_s']:.3f} s of CPU against compute only's {compute['cpu_s']:.3f} s "
            f"(compressing, the owners' decoding, summing and re-encoding, decoding the gathered shards): "
            f"{extra:+.3f} s, which {result['workers']} ranks on {cores} cores turn into at least {wall:.3f} s of "
            f"wall time; with the bound that is {way['bound_s'] + wall:.3f} s of the {way['step_s']:.3f} s step. "
            f"The rest is the two phases' latency (the owners re-encode between them) and the other jobs' load.")


def write(result: dict, results_dir: Path, command: str) -> None:
    table = summarise(result, extra=("backward_s", "link_bytes", "cpu_s"))
    result = {**result, "summary": table}
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "scatter_gather_step.json").write_text(json.dumps(result, indent=1))
    rows, verdicts = [], []
    for model, rates in table.items():
        record = result["models"][model]
        for rate_key, ways in rates.items():
            for name, row in ways.items():
                low, high = row["step_s_range"]
                q1, q3 = row["vs_bound_quartiles"]
                volumes = "- | -" if name == COMPUTE else \
                    f"{row['wire_bytes'] / 1e6:.2f} | {row['link_bytes'] / 1e6:.2f}"
                rows.append(f"| {label(float(rate_key))} | {name} | **{row['step_s']:.3f}** | {low:.3f}-{high:.3f} | "
                            f"{row['backward_s']:.3f} | {row['cpu_s']:.3f} | {volumes} | {row['bound_s']:.3f} | "
                            f"{row['vs_bound']:.2f} ({q1:.2f}-{q3:.2f}) | {row['speedup_vs_dense']:.2f}x | "
                            f"{row['steps']} |")
            scatter, dense, gather = ways[SCATTER], ways[DENSE], ways[GATHER]
            compute = ways[COMPUTE]
            met = scatter["speedup_vs_dense"] >= SPEEDUP_TARGET
            verdicts.append(
                f"- **{label(float(rate_key))}, {result['workers']} workers, {model} "
                f"({record['parameters'] / 1e6:.1f}M parameters):** ScatterGather QSGD(127) steps in "
                f"{scatter['step_s']:.3f} s against dense's {dense['step_s']:.3f} s: "
                f"**{scatter['speedup_vs_dense']:.2f}x faster** ({'meets' if met else 'misses'} the "
                f"{SPEEDUP_TARGET:g}x target), at **{scatter['vs_bound']:.2f}x its lower bound** (paired by "
                f"iteration; quartiles {scatter['vs_bound_quartiles'][0]:.2f}-{scatter['vs_bound_quartiles'][1]:.2f}; "
                f"the medians' bound {scatter['bound_s']:.3f} s = compute {compute['step_s']:.3f} s + "
                f"{scatter['wire_bytes'] / 1e6:.2f} MB at the rate). Dense is at {dense['vs_bound']:.2f}x its "
                f"bound. The same payload gathered (QSGD(127) allgather) steps in {gather['step_s']:.3f} s "
                f"({gather['speedup_vs_dense']:.2f}x dense's speed): {gather['wire_bytes'] / 1e6:.2f} MB per rank "
                f"against dense's {dense['wire_bytes'] / 1e6:.2f} MB.{cpu_clause(scatter, compute, result)}")
    text = f"""# Step time at 100 Mbit/s: ScatterGather QSGD(127) against dense allreduce

`{command}` (needs root)

Machine: {result['machine']}. Load: `{result['uptime'][0]}` before and `{result['uptime'][1]}` after the
run ({result.get('duration_s', 0) / 60:.0f} minutes); other jobs shared the cores. {result['workers']} Horovod
workers over Gloo TCP, each in its own network namespace, on veth links to a bridge, every link
limited in both directions with `tc tbf` (a full-duplex link of the given rate per worker). The
{result['workers']} workers share the machine's {result.get('cores', '?')} cores, so the compute part and
the compression are slower than on separate hosts; the ways are interleaved step by step so they
see the same load.

Per way: the median (and range) over steps of the slowest rank's step time; *backward* the part
up to the end of the backward pass; *CPU* each rank's CPU seconds per step (the ranks' mean);
*wire* what the step's collectives need on the busiest rank's link (counted at grace_legacy's
backend; dense: a ring allreduce of the gradients); *link* the busiest link's bytes as its
interface counts them (frames: TCP/IP headers and Horovod's coordination included); *bound*
`compute only + wire / rate` (medians); *vs bound* the median over iterations of each step over
its own iteration's bound, with quartiles; *vs dense* dense's median step over the way's.

| rate | way | step s | range s | backward s | CPU s | wire MB | link MB | bound s | vs bound | vs dense | steps |
|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

{chr(10).join(verdicts)}

![step time](scatter_gather_step.png)
"""
    (results_dir / "scatter_gather_step.md").write_text(text)
    plot(table, result, results_dir / "scatter_gather_step.png")


def plot(table: dict, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {COMPUTE: "#999", DENSE: "#c44", SCATTER: "#a5a", GATHER: "#e90"}
    panels = [(model, rate_key, ways) for model, rates in table.items() for rate_key, ways in rates.items()]
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for axis, (model, rate_key, ways) in zip(axes[0], panels, strict=True):
        names = [name for name in WAYS if name in ways]
        xs = range(len(names))
        axis.bar(xs, [ways[n]["step_s"] for n in names], color=[colours[n] for n in names], alpha=0.8,
                 label="step time (median)")
        axis.scatter(xs, [ways[n]["bound_s"] for n in names], marker="_", s=900, color="black", zorder=3,
                     label="lower bound: compute + wire / rate")
        for x, name in zip(xs, names, strict=True):
            axis.annotate(f"{ways[name]['step_s']:.2f} s", (x, ways[name]["step_s"]), ha="center",
                          xytext=(0, 3), textcoords="offset points", fontsize=8)
        axis.set_xticks(list(xs), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
        axis.set_ylabel("training step time (s)")
        axis.set_ylim(0, 1.3 * max(ways[n]["step_s"] for n in names))
        parameters = result["models"][model]["parameters"]
        axis.set_title(f"{model}, {parameters / 1e6:.1f}M parameters, {result['workers']} workers, "
                       f"{label(float(rate_key))}")
        axis.grid(True, axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = limited_link.parser(__doc__, "a tiny model, two steps: a smoke run", "dense and allgather",
                                 "dense and allgather")
    parser.add_argument("--workers", type=int, default=WORKERS, help="Horovod workers, one per namespace")
    parser.set_defaults(models=["mlp"], rates=[RATE])
    args = limited_link.parse(parser, full_steps=16)
    if args.worker:
        worker(args)
        return
    limited_link.drive("benchmarks.performance.scatter_gather_step", args, launch, write, lambda result: {
        model: {label(float(r)): {n: round(w["step_s"], 3) for n, w in ways.items()} for r, ways in rates.items()}
        for model, rates in summarise(result, extra=()).items()})


if __name__ == "__main__":
    main()
