"""Collective count and communication time: fused buckets vs one collective per tensor.

    python -m benchmarks.performance.fusion            # the full run (about 2 minutes here)
    python -m benchmarks.performance.fusion --quick    # a smoke run (seconds)

Four Horovod workers (``horovodrun -np 4 --gloo``) exchange the Top-k payloads of a model with
120 parameter tensors. Payloads are compressed beforehand, so the time measured is the
communication alone: packing, the collectives, unpacking and aggregating. Four ways are timed
side by side, interleaved, in one run: GRACE's reference style (two allgathers per tensor, values
and indices apart, each rank's part decompressed and summed), grace-legacy with every tensor on
its own (``bucket_bytes=0``: one packed allgather per tensor), fused buckets (64 MiB), and, for
reference, Horovod's own dense allreduce of the same gradients. Each timing is the slowest
rank's, per iteration; the table reports the median. The fused way is then run again in
iterations of its own, timed phase by phase (packing and submitting, waiting for the allgather,
unpacking and aggregating), to show where its time goes. Every way, the references included,
waits for its collectives asleep (:func:`grace_legacy.backends.horovod.synchronize`, as
grace_legacy's backend does), so that only the exchange differs.

Last, in this one process and with no collective, the CPU work of a bucket is timed both ways the
library can lay it out, interleaved: *by part* (every member's values, then every member's
indices: :func:`grace_legacy.runtime.wire.pack_columns`, :func:`~grace_legacy.runtime.wire.unpack_columns`,
:func:`~grace_legacy.compressors.sparse.scatter_sum_columns`), which a Top-k bucket takes, and
*member by member* (:func:`~grace_legacy.runtime.wire.pack_many`, :func:`~grace_legacy.runtime.wire.unpack_stacked`,
:func:`~grace_legacy.compressors.sparse.scatter_sum_many`), which buckets whose parts do not line
up take. The 4 ranks' buffers are real packs of 4 different gradients' payloads; both ways must
give the same sums, bit for bit.

The run is made twice: with Horovod's own tensor fusion on (its default: collectives submitted
within one cycle are merged in its background thread, which already hides much of the
per-tensor cost) and off (``HOROVOD_FUSION_THRESHOLD=0``, one collective on the wire per call).
Results go to ``benchmarks/results/performance.md`` (section "fusion") and
``benchmarks/results/fusion.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

GRACE = "GRACE reference (2 allgathers per tensor)"
PER_TENSOR = "per tensor"
BUCKET_BYTES = 64 * 1024 * 1024
HOROVOD_FUSION = {"on": {"HOROVOD_FUSION_THRESHOLD": None}, "off": {"HOROVOD_FUSION_THRESHOLD": "0"}}
PHASES = ("pack and submit", "wait for the allgather", "unpack and aggregate")


def model_shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """40 blocks of (weight, bias, projection): 120 tensors, 3.3M parameters (fewer if quick)."""
    blocks = 8 if quick else 40
    shapes = []
    for b in range(blocks):
        shapes += [(f"block{b}.weight", (256, 256)), (f"block{b}.bias", (256,)), (f"block{b}.proj", (64, 256))]
    return shapes


def worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    from grace_legacy import Allgather, TopK
    from grace_legacy.backends.horovod import HorovodBackend, synchronize
    from grace_legacy.communicators.exchange import BucketExchange
    from grace_legacy.communicators.fusion import BucketPlan, Fusion
    from grace_legacy.compressors.sparse import SparseContext
    from grace_legacy.core.communicator import Parcel

    hvd.init()
    torch.set_num_threads(1)

    class CountingBackend(HorovodBackend):
        """Horovod's backend, counting the collectives submitted and the seconds spent waiting."""

        def __init__(self) -> None:
            super().__init__()
            self.collectives = 0
            self.waiting = 0.0

        def allreduce_async(self, tensor, name, average):
            self.collectives += 1
            return super().allreduce_async(tensor, name, average)

        def allgather_async(self, tensor, name):
            self.collectives += 1
            return super().allgather_async(tensor, name)

        def wait(self, handle):
            start = time.perf_counter()
            try:
                return super().wait(handle)
            finally:
                self.waiting += time.perf_counter() - start

    shapes = model_shapes(args.quick)
    generator = torch.Generator().manual_seed(hvd.rank())
    grads = {name: torch.randn(shape, generator=generator) for name, shape in shapes}
    compressor = TopK(args.density)
    compressed = {name: compressor.compress(g, name) for name, g in grads.items()}
    order = [name for name, _ in reversed(shapes)]
    # Fixed rather than HOROVOD_FUSION_THRESHOLD, which this benchmark varies for Horovod itself.
    sizes = [(n, grads[n].numel() * 4) for n in order]
    plan = BucketPlan(sizes, BUCKET_BYTES)
    backend = CountingBackend()
    gather = Allgather()

    def members():
        return [Parcel(n, compressed[n][0], compressed[n][1], compressor, gather) for n in order]

    def per_tensor():
        flights = [(m, BucketExchange(m.name, [m], backend, True)) for m in members()]
        return [m.pending() for m, _ in flights]

    def grace_reference():
        handles = [(n, hvd.allgather_async(compressed[n][0][0], name=f"grace.values.{n}"),
                    hvd.allgather_async(compressed[n][0][1], name=f"grace.indices.{n}")) for n in order]
        out = []
        for n, values, indices in handles:
            ctx: SparseContext = compressed[n][1]
            values, indices = synchronize(values), synchronize(indices)
            total = torch.zeros(ctx.numel, dtype=ctx.dtype)
            for rank_values, rank_indices in zip(values.chunk(hvd.size()), indices.chunk(hvd.size()), strict=True):
                total += compressor.decompress([rank_values, rank_indices], ctx).view(-1)
            out.append((total / hvd.size()).view(ctx.shape))
        return out

    def fused(packed_at: list[float] | None = None):
        fusion = Fusion(BUCKET_BYTES)
        fusion.plan_buckets(sizes)
        pending = [fusion.send(m, backend, True) for m in members()]
        if packed_at is not None:  # every bucket is packed and its collective submitted
            packed_at.append(time.perf_counter())
        return [p() for p in pending]

    def dense():
        handles = [hvd.allreduce_async(grads[n], name=f"dense.{n}", op=hvd.Average) for n in order]
        return [synchronize(h) for h in handles]

    ways = {GRACE: grace_reference, PER_TENSOR: per_tensor,
            "fused": fused, "dense allreduce (Horovod)": dense}
    # Same results every way, checked once before timing.
    for a, b, c in zip(per_tensor(), fused(), grace_reference(), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)
    times = {way: [] for way in ways}
    counts = {}
    barrier = torch.zeros(1)
    for iteration in range(args.warmup + args.iterations):
        for way, run in ways.items():
            synchronize(hvd.allreduce_async(barrier, name="barrier"))
            before = backend.collectives
            start = time.perf_counter()
            run()
            elapsed = torch.tensor([time.perf_counter() - start])
            slowest = synchronize(hvd.allreduce_async(elapsed, name="slowest", op=hvd.Max)).item()
            counts[way] = {"dense allreduce (Horovod)": len(order), GRACE: 2 * len(order)}.get(
                way, backend.collectives - before)
            if iteration >= args.warmup:
                times[way].append(slowest)
    # Where the fused way's time goes, in iterations of their own (marks inside the timed way
    # would disturb it): each phase's slowest rank.
    phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for iteration in range(args.warmup + args.iterations):
        synchronize(hvd.allreduce_async(barrier, name="barrier"))
        backend.waiting = 0.0
        start, packed_at = time.perf_counter(), []
        fused(packed_at)
        total = time.perf_counter() - start
        packing = packed_at[0] - start
        spent = [packing, backend.waiting, total - packing - backend.waiting]
        slowest = synchronize(hvd.allreduce_async(torch.tensor(spent), name="slowest phases", op=hvd.Max)).tolist()
        if iteration >= args.warmup:
            for phase, seconds in zip(PHASES, slowest, strict=True):
                phases[phase].append(seconds)
    if hvd.rank() == 0:
        payload_bytes = sum(sum(p.numel() * p.element_size() for p in payload) for payload, _ in compressed.values())
        Path(args.json).write_text(json.dumps({
            "tensors": len(order), "parameters": sum(g.numel() for g in grads.values()),
            "buckets": len(plan.buckets), "bucket_bytes": plan.bucket_bytes, "density": args.density,
            "payload_bytes_per_rank": payload_bytes, "collectives": counts,
            "median_ms": {w: 1000 * statistics.median(t) for w, t in times.items()},
            "fused_phases_median_ms": {p: 1000 * statistics.median(t) for p, t in phases.items()},
            "times_ms": {w: [1000 * x for x in t] for w, t in times.items()},
        }))


def bucket_layouts(quick: bool, density: float, world: int = 4, repetitions: int = 31) -> dict:
    """Pack, unpack and aggregate of one bucket, by part against member by member (see the module
    doc), in this process: median ms of each and the median of the paired ratios."""
    import torch

    from grace_legacy import TopK
    from grace_legacy.compressors.sparse import scatter_sum_columns, scatter_sum_many
    from grace_legacy.runtime import wire

    torch.set_num_threads(1)
    shapes = model_shapes(quick)
    compressor = TopK(density)
    payloads = []  # payloads[rank][member]
    for rank in range(world):
        generator = torch.Generator().manual_seed(rank)
        payloads.append([compressor.compress(torch.randn(shape, generator=generator), name)
                         for name, shape in reversed(shapes)])
    local = [payload for payload, _ in payloads[0]]
    contexts = [ctx for _, ctx in payloads[0]]
    layout = wire.columns(local)
    members = [(payload, False) for payload in local]
    by_part_gathered = torch.cat([wire.pack_columns([p for p, _ in payloads[r]], layout) for r in range(world)])
    by_member_gathered = torch.cat([wire.pack_many([(p, False) for p, _ in payloads[r]]) for r in range(world)])

    def by_part():
        wire.pack_columns(local, layout)
        values, indices = wire.unpack_columns(by_part_gathered, layout, world, "bucket")
        return scatter_sum_columns(values, indices, layout.counts[0], contexts, True)

    def by_member():
        wire.pack_many(members)
        stacked = wire.unpack_stacked(by_member_gathered, members, world, "bucket")
        return scatter_sum_many([(values, indices, ctx) for (values, indices), ctx in zip(stacked, contexts,
                                                                                            strict=True)], True)

    ways = {"by part": by_part, "member by member": by_member}
    for got, want in zip(by_part(), by_member(), strict=True):
        assert torch.equal(got, want)
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repetitions):
        for way, run in ways.items():
            start = time.perf_counter()
            run()
            times[way].append(1000 * (time.perf_counter() - start))
    ratios = [slow / fast for slow, fast in zip(times["member by member"], times["by part"], strict=True)]
    return {"tensors": len(shapes), "ranks": world, "repetitions": repetitions,
            "median_ms": {way: statistics.median(t) for way, t in times.items()},
            "ratio": statistics.median(ratios)}


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.report import load_average, machine, run_workers

    before, this_machine = load_average(), machine()  # before bucket_layouts sets torch's threads
    options = ["--density", str(args.density), "--iterations", str(args.iterations), "--warmup", str(args.warmup)]
    if args.quick:
        options.append("--quick")
    runs = {setting: run_workers("benchmarks.performance.fusion", 4, *options, env=env)
            for setting, env in HOROVOD_FUSION.items()}
    layouts = bucket_layouts(args.quick, args.density)
    return {"runs": runs, "layouts": layouts, "machine": this_machine, "load_average": [before, load_average()]}


def write(result: dict, results_dir: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.common.report import load_note, median_interval, update_section

    runs = result["runs"]
    first = runs["on"]
    rows, verdicts = [], []
    for setting, run in runs.items():
        med = run["median_ms"]
        rows += [f"| {setting} | {way} | {run['collectives'][way]} | {ms:.2f} | "
                 f"{med[GRACE] / ms:.2f}x | {med[PER_TENSOR] / ms:.2f}x |" for way, ms in med.items()]
        gains = {}
        for way in (PER_TENSOR, GRACE):
            # Paired by iteration: both ways ran back to back, so a slow spell of the machine
            # weighs on both sides of each ratio.
            paired = [other / fused for other, fused in zip(run["times_ms"][way], run["times_ms"]["fused"],
                                                             strict=True)]
            gains[way] = (statistics.median(paired), *median_interval(paired))
        verdicts.append(
            f"- Horovod fusion {setting}: fused takes **{gains[PER_TENSOR][0]:.2f}x** less time than grace-legacy "
            f"per tensor (median of the per-iteration ratios; 95% interval {gains[PER_TENSOR][1]:.2f}-"
            f"{gains[PER_TENSOR][2]:.2f}) and **{gains[GRACE][0]:.2f}x** less than GRACE's reference "
            f"({gains[GRACE][1]:.2f}-{gains[GRACE][2]:.2f}): the 2x target against per tensor is "
            f"{'met' if gains[PER_TENSOR][0] >= 2 else 'not met'}, against the reference "
            f"{'met' if gains[GRACE][0] >= 2 else 'not met'}.")
        if "fused_phases_median_ms" in run:
            spent = ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in run["fused_phases_median_ms"].items())
            verdicts.append(f"  Fused, phase by phase (the same steps in iterations of their own, slowest rank's "
                            f"median): {spent}.")
    layouts = result["layouts"]
    verdicts.append(
        f"- The bucket's CPU work (pack, unpack, aggregate; {layouts['tensors']} tensors, {layouts['ranks']} "
        f"ranks' payloads, one process, no collective, median of {layouts['repetitions']} interleaved "
        f"repetitions): by part {layouts['median_ms']['by part']:.2f} ms, member by member "
        f"{layouts['median_ms']['member by member']:.2f} ms: by part is **{layouts['ratio']:.2f}x** faster "
        f"(median of the paired ratios), with the same sums bit for bit.")
    table = "\n".join(rows)
    verdict = "\n".join(verdicts)
    text = f"""## Fused communication: collectives and communication time

`{command}`

Machine: {result['machine']}; {load_note(result['load_average'])}.
4 Horovod workers on Gloo, on this one machine (loopback: latency per collective is small here,
so fusion gains less than it does across real hosts).
Model: {first['tensors']} parameter tensors, {first['parameters']:,} fp32 parameters; Top-k at density
{first['density']} ({first['payload_bytes_per_rank']:,} payload bytes per rank), compressed before timing,
so the times are communication only (pack, collectives, unpack, aggregate). Fused: {first['buckets']} bucket(s)
of up to {first['bucket_bytes']:,} dense bytes. Median over {len(first['times_ms']['fused'])} interleaved
iterations of the slowest rank's time. "Horovod fusion" is Horovod's own background merging of
collectives (`HOROVOD_FUSION_THRESHOLD` default vs `0`).

| Horovod fusion | way | collectives per step | median ms | speed-up vs GRACE reference | vs per tensor |
|---|---|---|---|---|---|
{table}

{verdict}

![communication time](fusion.png)
"""
    update_section(results_dir / "performance.md", "fusion", text, title="Performance results")
    figure, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3), sharex=True)
    for axis, (setting, run) in zip(axes, runs.items(), strict=True):
        med = run["median_ms"]
        axis.barh(list(med), list(med.values()), color=["#a5a", "#c44", "#4a4", "#888"])
        axis.set_xlabel("communication time per step (ms, median, slowest rank)")
        axis.set_title(f"Horovod fusion {setting}")
    figure.suptitle(f"{first['tensors']} tensors, Top-k density {first['density']}, 4 workers (Gloo)")
    figure.tight_layout()
    figure.savefig(results_dir / "fusion.png", dpi=120)


def main() -> None:
    from benchmarks.common.report import Repeats, benchmark_main

    benchmark_main("benchmarks.performance.fusion", __doc__,
                   Repeats("--iterations", full=30, quick=3, warmup=3, quick_warmup=None),
                   worker=worker, launch=launch, write=write,
                   shown=lambda result: {setting: run["median_ms"] for setting, run in result["runs"].items()},
                   options=lambda parser: parser.add_argument("--density", type=float, default=0.01))


if __name__ == "__main__":
    main()
