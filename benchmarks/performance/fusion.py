"""Collective count and communication time: fused buckets vs one collective per tensor.

    python -m benchmarks.performance.fusion            # the full run (about 2 minutes here)
    python -m benchmarks.performance.fusion --quick    # a smoke run (seconds)

Four Horovod workers (``horovodrun -np 4 --gloo``) exchange the Top-k payloads of a model with
120 parameter tensors. Payloads are compressed beforehand, so the time measured is the
communication alone: packing, the collectives, unpacking and aggregating. Three ways are timed
side by side, interleaved, in one run: every tensor on its own (``bucket_bytes=0``), fused
buckets (Horovod's default 64 MiB threshold), and, for reference, Horovod's own dense allreduce
of the same gradients. Each timing is the slowest rank's, per iteration; the table reports the
median. Results go to ``benchmarks/results/performance.md`` (section "fusion") and
``benchmarks/results/fusion.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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

    from grace_legacy import TopK
    from grace_legacy.backends.horovod import HorovodBackend
    from grace_legacy.communicators.fusion import BucketPlan, Flight, FusedExchange, Member
    from grace_legacy.grace import default_bucket_bytes

    hvd.init()
    torch.set_num_threads(1)

    class CountingBackend(HorovodBackend):
        def __init__(self) -> None:
            super().__init__()
            self.collectives = 0

        def allreduce_async(self, tensor, name, average):
            self.collectives += 1
            return super().allreduce_async(tensor, name, average)

        def allgather_async(self, tensor, name):
            self.collectives += 1
            return super().allgather_async(tensor, name)

    shapes = model_shapes(args.quick)
    generator = torch.Generator().manual_seed(hvd.rank())
    grads = {name: torch.randn(shape, generator=generator) for name, shape in shapes}
    compressor = TopK(args.density)
    compressed = {name: compressor.compress(g, name) for name, g in grads.items()}
    order = [name for name, _ in reversed(shapes)]
    plan = BucketPlan([(n, grads[n].numel() * 4) for n in order], default_bucket_bytes())
    backend = CountingBackend()

    def members():
        return [Member(n, compressed[n][0], compressed[n][1], compressor, gathered=True) for n in order]

    def per_tensor():
        flights = [(m, Flight(m.name, [m], backend, True)) for m in members()]
        return [m.pending() for m, _ in flights]

    def fused():
        exchange = FusedExchange(plan)
        pending = [exchange.add(m, backend, True) for m in members()]
        return [p() for p in pending]

    def dense():
        handles = [hvd.allreduce_async(grads[n], name=f"dense.{n}", op=hvd.Average) for n in order]
        return [hvd.synchronize(h) for h in handles]

    ways = {"per tensor": per_tensor, "fused": fused, "dense allreduce (Horovod)": dense}
    # Same results either way, checked once before timing.
    for a, b in zip(per_tensor(), fused(), strict=True):
        assert torch.equal(a, b)
    times = {way: [] for way in ways}
    counts = {}
    barrier = torch.zeros(1)
    for iteration in range(args.warmup + args.iterations):
        for way, run in ways.items():
            hvd.allreduce(barrier, name="barrier")
            before = backend.collectives
            start = time.perf_counter()
            run()
            elapsed = torch.tensor([time.perf_counter() - start])
            slowest = hvd.allreduce(elapsed, name="slowest", op=hvd.Max).item()
            counts[way] = backend.collectives - before if way != "dense allreduce (Horovod)" else len(order)
            if iteration >= args.warmup:
                times[way].append(slowest)
    if hvd.rank() == 0:
        payload_bytes = sum(sum(p.numel() * p.element_size() for p in payload) for payload, _ in compressed.values())
        Path(args.json).write_text(json.dumps({
            "tensors": len(order), "parameters": sum(g.numel() for g in grads.values()),
            "buckets": len(plan.buckets), "bucket_bytes": plan.bucket_bytes, "density": args.density,
            "payload_bytes_per_rank": payload_bytes, "collectives": counts,
            "median_ms": {w: 1000 * statistics.median(t) for w, t in times.items()},
            "times_ms": {w: [1000 * x for x in t] for w, t in times.items()},
        }))


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.report import machine

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fusion.json"
        cmd = [str(Path(sys.executable).with_name("horovodrun")), "-np", "4", "-H", "localhost:4", "--gloo",
               sys.executable, "-m", "benchmarks.performance.fusion", "--worker", "--json", str(out),
               "--density", str(args.density), "--iterations", str(args.iterations), "--warmup", str(args.warmup)]
        if args.quick:
            cmd.append("--quick")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, cwd=REPO, env=env)
        result = json.loads(out.read_text())
    result["machine"] = machine()
    return result


def write(result: dict, results_dir: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import update_section

    med = result["median_ms"]
    per, fused = med["per tensor"], med["fused"]
    rows = "\n".join(f"| {way} | {result['collectives'][way]} | {ms:.2f} | {per / ms:.2f}x |"
                     for way, ms in med.items())
    text = f"""## Fused communication: collectives and communication time

`{command}`

Machine: {result['machine']}. 4 Horovod workers on Gloo, on this one machine.
Model: {result['tensors']} parameter tensors, {result['parameters']:,} fp32 parameters; Top-k at density
{result['density']} ({result['payload_bytes_per_rank']:,} payload bytes per rank), compressed before timing,
so the times are communication only (pack, collectives, unpack, aggregate). {result['buckets']} bucket(s) of up
to {result['bucket_bytes']:,} dense bytes. Median over {len(result['times_ms']['fused'])} interleaved
iterations of the slowest rank's time.

| way | collectives per step | median ms | speed-up vs per tensor |
|---|---|---|---|
{rows}

Fused vs per tensor: **{per / fused:.2f}x less communication time** (target: at least 2x), with
{result['collectives']['per tensor']} collectives becoming {result['collectives']['fused']}.

![communication time](fusion.png)
"""
    update_section(results_dir / "performance.md", "fusion", text, title="Performance results")
    figure, axis = plt.subplots(figsize=(6, 3))
    axis.barh(list(med), list(med.values()), color=["#c44", "#4a4", "#888"])
    axis.set_xlabel("communication time per step (ms, median, slowest rank)")
    axis.set_title(f"{result['tensors']} tensors, Top-k density {result['density']}, 4 workers (Gloo)")
    figure.tight_layout()
    figure.savefig(results_dir / "fusion.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iterations is None:
        args.iterations = 3 if args.quick else 30
    if args.worker:
        worker(args)
        return
    result = launch(args)
    command = "python -m benchmarks.performance.fusion" + (" --quick" if args.quick else "")
    write(result, args.results, command)
    print(json.dumps(result["median_ms"], indent=1))


if __name__ == "__main__":
    main()
