"""Bandwidth-limited training step: dense allreduce vs Top-k vs LEGACY at 1 Gbit/s to 10 Mbit/s.

    python -m benchmarks.performance.bandwidth            # the full run (25 minutes on 2 cores)
    python -m benchmarks.performance.bandwidth --quick    # a smoke run with tiny models

Needs root: four Horovod workers (``--workers``) run over Gloo TCP, each in its own Linux
network namespace, joined by veth links to a bridge whose ports are rate limited with ``tc``
token buckets in both directions (:mod:`benchmarks.common.netns`; the namespaces are made
and removed here, and traffic never leaves them). The rate is changed between phases while the
workers keep running.

Each worker trains the same two models (:mod:`benchmarks.common.step_models`, about 11M
parameters each, on fixed synthetic batches) four ways, side by side and interleaved step by
step: *compute only* (forward, backward and SGD with no communication: the compute time of the
lower bound), *dense* (Horovod's own allreduce, ``hvd.Compression.none``), *Top-k* (uniform
density 0.001 with error feedback, ``Grace(TopK(0.001), memory=Residual())``) and *LEGACY*
(``Legacy.budget_matched(TopK(), 0.001, by="layer", ...)``: the reference's layer-wise shape,
small tensors denser, scaled to send the same bytes as Top-k, also with error feedback).

A step is timed from forward to the end of ``optimizer.step()`` (which waits for the gradients),
on every rank after a barrier; the slowest rank's time counts. The lower bound of a way at rate
``B`` is ``compute time + wire bytes / B``, where the wire bytes are what its collectives must
put on each rank's link with bandwidth-optimal algorithms: ``2 (P-1)/P x`` the bytes of an
allreduce, ``(P-1) x`` the bytes a rank contributes to an allgather (counted at grace_legacy's
backend, so size headers and the per-step inf/NaN flags are in). Each step is held to the bound
of its own iteration (that iteration's compute-only step), and the median of those ratios is
reported: the four workers share the cores, so one compute-only step can take twice the next.
The bytes really seen on the link (Ethernet frames from the interface counters: TCP/IP headers
and Horovod's coordination traffic included, the larger of sent and received, the busiest link)
are reported next to them. Apart from the steps, every rank times Top-k + EF's own passes over
one step's gradients with all ranks at once (:func:`time_topk_passes`): no link makes them
shorter, so the bound plus their time is the step's floor on this machine, reported beside the
target.

grace_legacy waits for its collectives asleep (:func:`grace_legacy.backends.horovod.synchronize`),
and so do this benchmark's barrier and timing exchange; *dense* is Horovod's own optimizer, whose
wait spins. With four workers on fewer cores, a spinning rank takes CPU time from the others.
Results: ``benchmarks/results/performance.md`` (section "bandwidth"), ``bandwidth.json`` and
``bandwidth.png``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
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
    ring_allreduce_bytes,
    summarise,
    timed_on_link,
)

WORKERS = 4
DENSITY = 0.001
# LEGACY's shape, the reference's layer example (``--group_compressions 100,1,0.1
# --group_splits 10000,1000000``): tensors under 10k elements 1000x the density of those over 1M,
# those in between 10x; budget_matched scales it to Top-k's bytes.
LEGACY_SPLITS = [10_000, 1_000_000]
LEGACY_FACTORS = [1000.0, 10.0, 1.0]
WAYS = (COMPUTE, "dense", "Top-k", "LEGACY")
#: Top-k + EF's step at 100 Mbit/s, at most this many times its lower bound.
BOUND_TARGETS = {"resnet": 1.15, "transformer": 1.2}
# Dense steps are long at low rates: --dense-steps where its communication takes longer than
# LONG_STEP_S, --slow-steps and no warm-up beyond SLOW_STEP_S (10 Mbit/s costs a minute a step);
# see limited_link.plan_steps.
LEARNING_RATE = 1e-3


# -- the workers ---------------------------------------------------------------------------------------

@dataclass
class Way:
    name: str
    step_model: Any
    optimizer: Any
    compression: Any = None
    dense_bytes: int = 0

    def step(self) -> float:
        """One training step; returns when its backward pass ended (the hooks have compressed and
        launched every gradient by then: what follows is waiting for the collectives, and SGD)."""
        self.optimizer.zero_grad()
        self.step_model.loss().backward()
        backward_done = time.perf_counter()
        self.optimizer.step()
        return backward_done

    def payload_bytes(self) -> int:
        """Bytes this rank has handed to collectives so far (grace_legacy's count; Horovod keeps none)."""
        return self.compression.stats["bytes_sent"] if hasattr(self.compression, "stats") else 0


def build_way(name: str, model: str, quick: bool, hvd: Any) -> Way:
    import torch

    from benchmarks.common.step_models import build
    from benchmarks.common.training import broadcast_parameters
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
        # The quick run's tiny layers keep a handful of entries each, so their bytes move in steps
        # too coarse to meet the budget within the default 1%.
        schedule = Legacy.budget_matched(TopK(), DENSITY, by="layer", sizes=named, splits=LEGACY_SPLITS,
                                         layer_factors=LEGACY_FACTORS, world_size=hvd.size(),
                                         tolerance=0.05 if quick else 0.01)
        compression = Grace(schedule, memory=Residual())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
    broadcast_parameters(step_model.model.state_dict())
    return Way(name, step_model, optimizer, compression, sum(p.numel() * p.element_size() for _, p in named))


def count_collective_bytes(world_size: int) -> list[float]:
    """Make grace_legacy's Horovod backend count the link bytes its collectives need (see the
    module docstring); returns the running total, a one-element list."""
    from grace_legacy.backends.horovod import HorovodBackend

    total = [0.0]
    allreduce, allgather = HorovodBackend.allreduce_async, HorovodBackend.allgather_async

    def counting_allreduce(self: HorovodBackend, tensor: Any, name: str, average: bool) -> Any:
        total[0] += ring_allreduce_bytes(tensor.numel() * tensor.element_size(), world_size)
        return allreduce(self, tensor, name, average)

    def counting_allgather(self: HorovodBackend, tensor: Any, name: str) -> Any:
        total[0] += (world_size - 1) * tensor.numel() * tensor.element_size()
        return allgather(self, tensor, name)

    HorovodBackend.allreduce_async, HorovodBackend.allgather_async = counting_allreduce, counting_allgather
    return total


def over_ranks(hvd: Any, values: list[float], name: str, op: Any) -> list[float]:
    """``values`` reduced over the ranks by ``op`` (one float64 allreduce, waited for asleep)."""
    import torch

    from grace_legacy.backends.horovod import synchronize

    return synchronize(hvd.allreduce_async(torch.tensor(values, dtype=torch.float64), name=name, op=op)).tolist()


def slowest_medians(hvd: Any, barrier: Any, name: str, timed: Any, prepare: Any = None,
                    repeats: int = 5) -> list[float]:
    """For each duration (seconds) that ``timed()`` returns, the median over ``repeats`` runs of
    the slowest rank's, every run started on all ranks at once (after ``prepare()``, untimed, and a
    barrier); one warm-up run first."""
    runs = []
    for repeat in range(repeats + 1):
        if prepare is not None:
            prepare()
        barrier()
        slowest = over_ranks(hvd, timed(), f"{name}.{repeat}", hvd.Max)
        if repeat:
            runs.append(slowest)
    return [statistics.median(column) for column in zip(*runs, strict=True)]


def time_topk_passes(parameters: list[Any], barrier: Any, hvd: Any) -> dict[str, float]:
    """What Top-k + EF's three passes over one step's gradients take, timed apart from any step
    with all ranks at once (as in a step, where the ranks share the cores): the error-feedback add
    ``g += e`` (as ``Residual.compensate_into`` does it), the selection (``TopK.compress``), and
    clearing the dense buffer the aggregate is scattered into (as a kept bucket buffer is cleared).
    Every rank makes them in every step whatever the link, so the bound plus their time is a floor
    for the step on this machine. Per pass and for the three together (``total``), the slowest
    rank's time (:func:`slowest_medians`)."""
    import torch

    from grace_legacy import TopK
    from grace_legacy.runtime.buffers import zeroed

    generator = torch.Generator().manual_seed(hvd.rank())
    grads = [torch.randn(p.shape, generator=generator) for p in parameters]
    residuals = [0.1 * torch.randn(p.shape, generator=generator) for p in parameters]
    dense = torch.zeros(sum(p.numel() for p in parameters))
    topk = TopK(DENSITY)
    compensated: list[Any] = []

    def prepare() -> None:
        compensated[:] = [grad.clone() for grad in grads]

    def passes() -> list[float]:
        start = time.perf_counter()
        for tensor, residual in zip(compensated, residuals, strict=True):
            tensor.add_(residual)
        added = time.perf_counter()
        for index, tensor in enumerate(compensated):
            topk.compress(tensor, str(index))
        selected = time.perf_counter()
        zeroed(dense)
        cleared = time.perf_counter()
        return [added - start, selected - added, cleared - selected, cleared - start]

    medians = slowest_medians(hvd, barrier, "bandwidth.passes", passes, prepare)
    return dict(zip(("add", "select", "clear", "total"), medians, strict=True))


def time_tiny_allgather(barrier: Any, hvd: Any) -> float:
    """What an allgather of a few bytes takes on the link, with all ranks at once: the part of
    the last bucket's collective that no byte count accounts for (Horovod's negotiation, the
    round trips). Top-k's last bucket is launched when the backward pass ends, so every step
    waits at least this long after it. The slowest rank's time (:func:`slowest_medians`)."""
    import torch

    from grace_legacy.backends.horovod import synchronize

    tiny = torch.zeros(2)
    gathers = itertools.count()  # each gather under a name of its own

    def gather() -> list[float]:
        start = time.perf_counter()
        synchronize(hvd.allgather_async(tiny, name=f"bandwidth.tiny.{next(gathers)}"))
        return [time.perf_counter() - start]

    return slowest_medians(hvd, barrier, "bandwidth.tiny.time", gather)[0]


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import grace_legacy  # noqa: F401  (lets hvd.DistributedOptimizer take grace_legacy compression)
    from grace_legacy.backends.horovod import synchronize

    hvd.init()
    torch.set_num_threads(1)
    collective_bytes = count_collective_bytes(hvd.size())
    control = Path(args.control)
    barrier_flag = torch.zeros(1)

    # The harness's own collectives wait asleep, as grace_legacy's do: a rank spinning in
    # Horovod's wait would take CPU time from the ranks still inside a timed step.
    def barrier() -> None:
        synchronize(hvd.allreduce_async(barrier_flag, name="bandwidth.barrier"))

    def timed_step(way: Way) -> dict[str, float]:
        barrier()
        payload_before, needed_before = way.payload_bytes(), collective_bytes[0]
        process_cpu, main_cpu = time.process_time(), time.thread_time()
        elapsed, backward, seen = timed_on_link(way.step)
        process_cpu, main_cpu = time.process_time() - process_cpu, time.thread_time() - main_cpu
        if way.name == "dense":  # Horovod's own allreduce, not grace_legacy's backend
            payload, needed = way.dense_bytes, ring_allreduce_bytes(way.dense_bytes, hvd.size())
        else:
            payload, needed = way.payload_bytes() - payload_before, collective_bytes[0] - needed_before
        slowest = over_ranks(hvd, [elapsed, backward, float(seen), needed], "bandwidth.slowest", hvd.Max)
        # CPU time, the ranks' mean: with more ranks than cores, every rank's CPU second is wall time too.
        cpu = over_ranks(hvd, [process_cpu, main_cpu], "bandwidth.cpu", hvd.Average)
        return {"step_s": slowest[0], "backward_s": slowest[1], "link_bytes": slowest[2], "wire_bytes": slowest[3],
                "payload_bytes": payload, "cpu_s": cpu[0], "main_thread_cpu_s": cpu[1]}

    results: dict[str, Any] = {"workers": hvd.size(), "density": DENSITY, "models": {}}
    request = 0
    for model in args.models:
        ways = {name: build_way(name, model, args.quick, hvd) for name in WAYS}
        parameters = [p for p in ways["compute only"].step_model.model.parameters()]
        numel = sum(p.numel() for p in parameters)
        dense_wire = ring_allreduce_bytes(4 * numel, hvd.size())
        record: dict[str, Any] = {
            "parameters": numel, "tensors": len(parameters),
            "legacy": repr(ways["LEGACY"].compression.compressor), "rates": {}}
        for phase, rate in enumerate(args.rates):
            request_rate(control, request, rate, hvd.rank() == 0, barrier)
            request += 1
            plan = plan_steps({name: dense_wire * 8 / rate if name == "dense" else 0.0 for name in WAYS},
                              phase == 0, args.warmup, args.steps, args.dense_steps, args.slow_steps)
            measured = interleave(plan, lambda name, ways=ways: timed_step(ways[name]))
            record["rates"][repr(rate)] = measured
            record.setdefault("tiny_allgather_s", {})[repr(rate)] = time_tiny_allgather(barrier, hvd)
            if hvd.rank() == 0:
                print(f"{model} at {label(rate)}: " + ", ".join(
                    f"{n} {statistics.median(m['step_s']):.3f} s" for n, m in measured.items()), flush=True)
        record["topk_passes_s"] = time_topk_passes(parameters, barrier, hvd)
        results["models"][model] = record
        del ways, parameters
        gc.collect()
    if hvd.rank() == 0:
        Path(args.json).write_text(json.dumps(results))


# -- the driver ----------------------------------------------------------------------------------------

def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.netns import HorovodJob

    # A 44 MB allreduce at 10 Mbit/s takes a minute: longer than Gloo's and Horovod's patience.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "900", "HOROVOD_STALL_CHECK_DISABLE": "1"}
    result = limited_link.launch_workers("benchmarks.performance.bandwidth", args, HorovodJob, args.workers, env)
    result["cores"] = len(os.sched_getaffinity(0))  # the workers' CPU time is shared out over these
    return result


TABLE_HEAD = ("| model | rate | way | step s | range s | backward s | payload MB | wire MB | link MB | lower bound s "
              "| vs bound | vs dense | steps |\n" + "|---" * 13 + "|")


def passes_clause(record: dict) -> str:
    """What Top-k + EF's passes over the gradients took, measured apart (:func:`time_topk_passes`;
    reports from before it measured the selection alone)."""
    passes = record.get("topk_passes_s")
    if passes is None:
        return (f"the Top-k selection alone takes about {record['topk_compress_s']:.3f} s, measured apart with "
                f"all ranks at once")
    return (f"its passes over the gradients, measured apart with all ranks at once: the error-feedback add "
            f"{passes['add']:.3f} s, the selection {passes['select']:.3f} s, and clearing the dense result "
            f"{passes['clear']:.3f} s")


def floor_sentence(record: dict, topk: dict, target: float, rate_key: str = repr(1e8)) -> str:
    """The step's floor on this machine: its bound plus the passes every rank makes in every step,
    and (where it was measured) the fixed cost of the one collective every step waits for after
    its backward pass."""
    passes = record.get("topk_passes_s")
    if passes is None:
        return ""
    floor = topk["bound_s"] + passes["total"]
    tiny = record.get("tiny_allgather_s", {}).get(rate_key)
    rest = "every tensor's hooks, the last bucket's collective and the scatter-add"
    alone = (f" Those passes alone ({passes['total']:.3f} s together on the slowest rank) put the step at "
             f"{floor / topk['bound_s']:.2f}x its bound on this machine")
    if tiny is not None:
        floor += tiny
        rest = "every tensor's hooks and the scatter-add"
        alone += (f"; with the wait for the last bucket's collective, at least what an allgather of a few bytes "
                  f"takes on this link ({tiny:.3f} s), {floor / topk['bound_s']:.2f}x")
    left = target * topk["bound_s"] - floor
    budget = (f"which leaves {left:.3f} s of the {target:g}x target's budget for everything else ({rest})"
              if left >= 0 else f"{-left:.3f} s past the {target:g}x target before {rest}")
    return f"{alone}, {budget}."


def cpu_sentence(way: dict, compute: dict, workers: int, cores: int | None) -> str:
    """What a way's step costs each rank in CPU time beyond compute-only's, and what that costs in
    wall time where the ranks outnumber the cores (reports from before it was measured: nothing)."""
    if "cpu_s" not in way or not cores:
        return ""
    extra, main = way["cpu_s"] - compute["cpu_s"], way["main_thread_cpu_s"] - compute["main_thread_cpu_s"]
    share = f"; with {workers} ranks on {cores} cores that is about {extra * workers / cores:.3f} s of wall time" \
        if workers > cores else ""
    return (f" Each rank's step took {way['cpu_s']:.3f} s of CPU against compute-only's {compute['cpu_s']:.3f} s "
            f"(medians of the ranks' mean): {extra:+.3f} s, {main:+.3f} s of it in the training thread and "
            f"{extra - main:+.3f} s in Horovod's and Gloo's threads{share}.")


def write(result: dict, results_dir: Path, command: str) -> None:
    from benchmarks.common.report import update_section

    table = summarise(result, extra=("backward_s", "link_bytes", "payload_bytes", "cpu_s", "main_thread_cpu_s"))
    result = {**result, "summary": table}
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "bandwidth.json").write_text(json.dumps(result, indent=1))
    rows, verdicts = [], []
    for model, rates in table.items():
        record = result["models"][model]
        for rate_key, ways in rates.items():
            for name, row in ways.items():
                low, high = row["step_s_range"]
                volumes = " | ".join("-" if name == "compute only" else f"{row[key] / 1e6:.3f}"
                                     for key in ("payload_bytes", "wire_bytes", "link_bytes"))
                rows.append(f"| {model} | {label(float(rate_key))} | {name} | **{row['step_s']:.3f}** | "
                            f"{low:.3f}-{high:.3f} | {row['backward_s']:.3f} | {volumes} | {row['bound_s']:.3f} | "
                            f"{row['vs_bound']:.2f} | {row['speedup_vs_dense']:.2f}x | {row['steps']} |")
        at_100 = rates.get(repr(1e8))
        if at_100:
            topk, legacy, compute = at_100["Top-k"], at_100["LEGACY"], at_100[COMPUTE]["step_s"]
            compute_backward = at_100[COMPUTE]["backward_s"]
            target = BOUND_TARGETS.get(model, 1.5)
            speedup_ok, bound_ok = topk["speedup_vs_dense"] >= 5, topk["vs_bound"] <= target
            verdicts.append(
                f"- **{model}** ({record['parameters'] / 1e6:.1f}M parameters, {record['tensors']} tensors) at "
                f"100 Mbit/s: Top-k {DENSITY} + EF steps in {topk['step_s']:.3f} s vs dense "
                f"{at_100['dense']['step_s']:.3f} s: **{topk['speedup_vs_dense']:.1f}x** faster "
                f"({'meets' if speedup_ok else 'misses'} the 5x target) and **{topk['vs_bound']:.2f}x** its lower "
                f"bound, paired step by step (quartiles {topk['vs_bound_quartiles'][0]:.2f}-"
                f"{topk['vs_bound_quartiles'][1]:.2f}; the medians' bound is {topk['bound_s']:.3f} s) "
                f"({'meets' if bound_ok else 'misses'} the {target:g}x target). "
                f"LEGACY at the same volume: {legacy['step_s']:.3f} s ({legacy['speedup_vs_dense']:.1f}x faster "
                f"than dense, {legacy['vs_bound']:.2f}x its bound). Of Top-k's "
                f"{topk['step_s'] - topk['bound_s']:.3f} s above the bound, "
                f"{topk['backward_s'] - compute_backward:.3f} s are spent in the backward pass beyond "
                f"compute's ({passes_clause(record)}) and "
                f"{topk['step_s'] - topk['backward_s'] - (compute - compute_backward):.3f} s after it beyond "
                f"compute's (waiting for the collectives, {topk['wire_bytes'] * 8 / 1e8:.3f} s of which the "
                f"bytes need at this rate).{floor_sentence(record, topk, target)}"
                f"{cpu_sentence(topk, at_100[COMPUTE], result['workers'], result.get('cores'))}")
    schedules = "\n".join(f"- {model}: `{record['legacy']}`" for model, record in result["models"].items())
    load = result.get("load_average", [float("nan")] * 2)
    cores = f"{result['cores']} " if result.get("cores") else ""
    text = f"""## Bandwidth-limited training step

`{command}`

Machine: {result['machine']}; load average {load[0]:.1f} before and {load[1]:.1f} after the run
({result.get('duration_s', 0) / 60:.0f} minutes). {result['workers']} Horovod workers over Gloo TCP,
each in its own network namespace, on veth links to a bridge, every link rate limited in both
directions with `tc tbf` (a full-duplex link of the given rate per worker). The {result['workers']} workers
share this machine's {cores}CPU cores (and, here, other jobs' load), so the compute part is slower and
noisier than on separate hosts; the ways are interleaved step by step so they see the same load.

Per model, rate and way: the median (and range) over steps of the slowest rank's step time
(forward, backward, communication, optimizer). *Backward*: the part of it up to the end of the
backward pass (for compressed ways, the compression and launch of every gradient in Horovod's
hooks are in it; the rest of the step is waiting for the collectives, the inf/NaN flags'
allreduce, and SGD). *Payload*: bytes a rank hands to its collectives
per step. *Wire*: what those collectives must put on each rank's link at the least (2(P-1)/P x
allreduced bytes + (P-1) x allgathered bytes). *Link*: bytes actually seen on the busiest link
(Ethernet frames: TCP/IP headers and Horovod's coordination traffic, which runs every cycle
even when idle, included). Lower bound: `compute only + wire / rate` (medians). *vs bound*: the
median over iterations of each step's time over its own bound, the compute-only step of the same
iteration + its wire bytes / rate (paired, so that a slow spell of the shared cores stretches both
sides alike). *vs dense*: dense's median step time / this way's.

Ways: dense = Horovod's allreduce (`hvd.Compression.none`); Top-k = `Grace(TopK({DENSITY}),
memory=Residual())`; LEGACY = `Legacy.budget_matched(TopK(), {DENSITY}, by="layer",
splits={LEGACY_SPLITS}, layer_factors={[int(f) for f in LEGACY_FACTORS]})` with `Residual()`, which
hands over as many bytes as Top-k:
{schedules}

{TABLE_HEAD}
{chr(10).join(rows)}

{chr(10).join(verdicts)}

![step time vs bandwidth](bandwidth.png)
"""
    update_section(results_dir / "performance.md", "bandwidth", text, title="Performance results")

    styles = {"dense": ("#c44", "o-"), "Top-k": ("#36b", "o-"), "LEGACY": ("#2a2", "o-")}
    limited_link.plot_step_times(result, table, styles, results_dir / "bandwidth.png", "workers", bounds=True)


def main() -> None:
    parser = limited_link.parser(__doc__, "tiny models, two rates, two steps: a smoke run", "dense", "dense")
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help="Horovod workers, one per namespace (fewer than the cores: each has a core of its own)")
    args = limited_link.parse(parser, full_steps=24)
    if args.worker:
        worker(args)
        return
    limited_link.drive("benchmarks.performance.bandwidth", args, launch, write, lambda result: {
        model: {label(float(r)): {n: round(w["step_s"], 3) for n, w in ways.items()} for r, ways in rates.items()}
        for model, rates in summarise(result).items()})


if __name__ == "__main__":
    main()
