"""Link bytes per rank and step at 4, 8 and 16 workers, read from the links' counters, against
the byte model (the planner's prediction and the bundle's ``stats["wire_bytes"]``).

    python -m benchmarks.performance.link_bytes            # 4, 8 and 16 workers, both engines
    python -m benchmarks.performance.link_bytes --quick    # a smoke run: 2 workers, a tiny model

Needs root: the workers run each in its own network namespace on the veth links of
:class:`~benchmarks.common.netns.Cluster` (no rate limit: bytes are the point), over both engines:
Horovod (:class:`~benchmarks.common.netns.HorovodJob`, Gloo, ``hvd.DistributedOptimizer``) and
plain ``torch.distributed`` (:class:`~benchmarks.common.netns.TorchJob`, Gloo, DDP with
``grace_legacy.ddp.register``). Every worker trains one small MLP (2.4M parameters, 8 tensors, one
fused bucket) one way after the other from the same seed: *dense* (Horovod's own allreduce / DDP's
own), then each compressor on each route, forced with ``Grace(C, communicator=Allgather() or
ScatterGather(), dense_fallback=False)`` so that every tensor takes that route: QSGD(127),
SignSGD, Top-k 0.01 and Top-k 0.001. A way's first steps are not measured (the ranks' set-ups are
compared there, and Horovod negotiates names it has not cached yet).

Per measured step, every rank reads its interface's counters before (after a barrier) and after
its step, and takes:

* **link**: the TCP payload, Ethernet frames less one set of headers per packet
  (:mod:`benchmarks.common.link_counters`), the mean of sent and received. Averaged over the
  ranks it is the step's traffic over the number of ranks, whichever rank carries more of it;
* **background**: what the links carry with no collective under way, measured in idle windows
  (every rank asleep, before and after the ways). Horovod's background thread coordinates the
  ranks every cycle, busy or not, with small messages on the same connections; torch.distributed
  sends next to nothing. A step is charged the smaller of two over-estimates
  (:func:`charge_overheads`): the idle rate times its duration (a step on shared cores runs fewer
  coordination cycles than an idle second) and its packets times the idle payload per packet;
* **framing** (torch.distributed): what one call of each kind puts on the link beyond its
  counted bytes (:func:`framing_per_call`: the sizes exchanged before a gather or an all-to-all,
  Gloo's header on each message), times the step's calls of that kind;
* **corrected**: *link - background - framing*;
* **collectives**: what grace_legacy's backend handed to the engine, as link bytes with
  bandwidth-optimal algorithms (:class:`~benchmarks.common.link_counters.CollectiveCounter`:
  the step's ``wire_bytes`` plus the per-step inf/NaN flags' allreduce); for dense, a ring
  allreduce of the gradients;
* **stats**: the step's ``stats["wire_bytes"]``;

and the **planner**: ``grace_legacy.planner.plan(C, shapes, world_size=P, route=R,
dense_fallback=False)``, the mean over the ranks of ``rank_link_bytes``. Ratios to dense divide
each way's corrected link bytes by dense's (the planner's by the planner's).

Results: ``benchmarks/results/link_bytes.md``, ``link_bytes.json`` and ``link_bytes.png``.
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
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = RESULTS.parents[1]

WORKER_COUNTS = (4, 8, 16)
QUICK_WORKER_COUNTS = (2,)
ENGINES = ("horovod", "torch")
#: The MLP's layer widths: 2.37M parameters in 8 tensors (9.5 MB), under one 16 MiB bucket.
WIDTHS = (256, 1024, 1024, 1024, 10)
QUICK_WIDTHS = (32, 128, 128, 10)
BATCH = 8
LEARNING_RATE = 1e-3
#: DDP's buckets (MiB), first one included: one bucket for the model, as the planner's 16 MiB
#: default puts it in one.
DDP_BUCKET_MB = 16
COMPRESSORS = ("QSGD(127)", "SignSGD", "Top-k 0.01", "Top-k 0.001")
ROUTES = ("allgather", "scattergather")
DENSE = "dense"
#: The issue's targets at 16 workers: a ScatterGather way's link bytes over dense's, at most.
TARGETS = {"QSGD(127)": 0.30, "SignSGD": 0.06, "Top-k 0.01": 0.05}
TARGET_WORKERS = 16


def make_compressor(name: str) -> Any:
    from grace_legacy import QSGD, SignSGD, TopK

    return {"QSGD(127)": lambda: QSGD(127), "SignSGD": SignSGD, "Top-k 0.01": lambda: TopK(0.01),
            "Top-k 0.001": lambda: TopK(0.001)}[name]()


def way_names() -> list[str]:
    return [DENSE] + [f"{c} {r}" for c in COMPRESSORS for r in ROUTES]


def split_way(way: str) -> tuple[str, str]:
    """(compressor, route) of a compressed way's name."""
    compressor, route = way.rsplit(" ", 1)
    return compressor, route


def make_compression(way: str) -> Any:
    """The way's ``Grace`` bundle (``None`` for dense)."""
    from grace_legacy import Allgather, Grace, ScatterGather

    if way == DENSE:
        return None
    compressor, route = split_way(way)
    communicator = Allgather() if route == "allgather" else ScatterGather()
    return Grace(make_compressor(compressor), communicator=communicator, dense_fallback=False)


def build_model(widths: tuple[int, ...]) -> nn.Module:
    from benchmarks.common.step_models import mlp

    return mlp(widths)


# -- the workers -----------------------------------------------------------------------------------

class HorovodEngine:
    """Horovod over Gloo: ``hvd.DistributedOptimizer`` with the way's bundle (dense: Horovod's own)."""

    name = "horovod"

    def __init__(self) -> None:
        import horovod.torch as hvd

        import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer takes grace_legacy bundles)
        from benchmarks.common.link_counters import CollectiveCounter
        from grace_legacy.backends.horovod import HorovodBackend, synchronize

        hvd.init()
        self.hvd, self._synchronize, self._flag = hvd, synchronize, torch.zeros(1)
        self.counter = CollectiveCounter().install(HorovodBackend)

    def rank(self) -> int:
        return self.hvd.rank()

    def size(self) -> int:
        return self.hvd.size()

    def barrier(self) -> None:
        # Waited for asleep, as grace_legacy waits: a spinning rank would slow the others.
        self._synchronize(self.hvd.allreduce_async(self._flag, name="link_bytes.barrier"))

    def build(self, index: int, model: nn.Module, compression: Any) -> tuple[nn.Module, Any, Callable[[], Any]]:
        # Names unique per way: one way's collectives are never mistaken for another's.
        named = [(f"w{index}.{name}", p) for name, p in model.named_parameters()]
        optimizer = self.hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LEARNING_RATE), named_parameters=named,
            compression=self.hvd.Compression.none if compression is None else compression)
        return model, optimizer, lambda: None if compression is None else optimizer.grace.stats

    def gather(self, value: Any) -> list[Any]:
        return self.hvd.allgather_object(value)

    def backend(self) -> Any:
        from grace_legacy.backends.horovod import HorovodBackend

        return HorovodBackend()


class TorchEngine:
    """torch.distributed over Gloo: DDP, with the way's bundle registered as its hook (dense: DDP's own)."""

    name = "torch"

    def __init__(self) -> None:
        import torch.distributed as dist

        from benchmarks.common.link_counters import CollectiveCounter
        from grace_legacy.backends.torch_distributed import TorchDistributedBackend

        dist.init_process_group("gloo", timeout=timedelta(minutes=15))
        self.dist, self._flag = dist, torch.zeros(1)
        self.counter = CollectiveCounter().install(TorchDistributedBackend)

    def rank(self) -> int:
        return self.dist.get_rank()

    def size(self) -> int:
        return self.dist.get_world_size()

    def barrier(self) -> None:
        self.dist.all_reduce(self._flag)

    def build(self, index: int, model: nn.Module, compression: Any) -> tuple[nn.Module, Any, Callable[[], Any]]:
        from torch.nn.parallel import DistributedDataParallel

        import grace_legacy.ddp

        ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_MB)
        state = None if compression is None else grace_legacy.ddp.register(ddp, compression)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
        return ddp, optimizer, lambda: None if state is None else state.stats

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.size()
        self.dist.all_gather_object(out, value)
        return out

    def backend(self) -> Any:
        from grace_legacy.backends.torch_distributed import TorchDistributedBackend

        return TorchDistributedBackend()


def framing_per_call(engine: Any, header: int, repeats: int) -> dict[str, float]:
    """Per kind of collective, the TCP payload one call puts on this rank's link beyond the bytes
    :class:`~benchmarks.common.link_counters.CollectiveCounter` counts for it, from ``repeats``
    calls with a payload of one element (per peer) through grace_legacy's backend: the engine's
    framing of each message and, for torch.distributed, the sizes it exchanges before a gather or
    an all-to-all. Under Horovod the background coordination of the same seconds is in it too."""
    from benchmarks.common.link_counters import read_link

    backend = engine.backend()
    size = engine.size()
    launches = {
        "allreduce": lambda i: backend.allreduce_async(torch.zeros(1), f"calibrate.allreduce.{i}", False),
        "allgather": lambda i: backend.allgather_async(torch.zeros(1, dtype=torch.uint8), f"calibrate.allgather.{i}"),
        "alltoall": lambda i: backend.alltoall_async(torch.zeros(size, dtype=torch.uint8), [1] * size,
                                                     f"calibrate.alltoall.{i}"),
    }
    out = {}
    for kind, launch in launches.items():
        backend.wait(launch(-1))
        engine.barrier()
        counted, before = engine.counter.total, read_link()
        for i in range(repeats):
            backend.wait(launch(i))
        moved = (read_link() - before).as_dict(header)
        out[kind] = ((moved["tx_payload"] + moved["rx_payload"]) / 2 - (engine.counter.total - counted)) / repeats
    return out


def worker(args: argparse.Namespace) -> None:
    from benchmarks.common.link_counters import header_bytes, read_link

    torch.set_num_threads(1)
    engine = HorovodEngine() if args.engine == "horovod" else TorchEngine()
    header = header_bytes()
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    generator = torch.Generator().manual_seed(engine.rank())
    x = torch.randn(BATCH, widths[0], generator=generator)
    y = torch.randint(0, widths[-1], (BATCH,), generator=generator)

    def idle_window() -> dict[str, float]:
        engine.barrier()
        before, start = read_link(), time.perf_counter()
        time.sleep(args.idle)
        seconds, after = time.perf_counter() - start, read_link()
        return {"s": seconds, **(after - before).as_dict(header)}

    record: dict[str, Any] = {"rank": engine.rank(), "header_bytes": header, "idle": [idle_window()], "ways": {}}
    for index, way in enumerate(args.ways):
        torch.manual_seed(0)
        compression = make_compression(way)
        model, optimizer, stats = engine.build(index, build_model(widths), compression)

        def step(model: nn.Module = model, optimizer: Any = optimizer) -> None:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        for _ in range(args.warmup):
            step()
        steps = []
        for _ in range(args.steps):
            engine.barrier()
            before_stats, before_count, before_calls = stats(), engine.counter.total, engine.counter.calls.copy()
            before, start = read_link(), time.perf_counter()
            step()
            seconds, after = time.perf_counter() - start, read_link()
            after_stats = stats()
            row = {"s": seconds, **(after - before).as_dict(header), "collectives": engine.counter.total - before_count,
                   "calls": dict(engine.counter.calls - before_calls)}
            if after_stats is not None:
                for key in ("wire_bytes", "wire_dense", "bytes_sent", "bytes_dense"):
                    row[key] = after_stats[key] - before_stats[key]
            steps.append(row)
        final = stats()
        record["ways"][way] = {"steps": steps, "routes": None if final is None else final["tensors_by_route"]}
        del model, optimizer, compression
    record["idle"].append(idle_window())
    record["framing"] = framing_per_call(engine, header, args.calibration)
    gathered = engine.gather(record)
    if engine.rank() == 0:
        Path(args.json).write_text(json.dumps({"engine": engine.name, "workers": engine.size(), "ranks": gathered}))


# -- the driver ------------------------------------------------------------------------------------

def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uptime unavailable"


def run_engine(args: argparse.Namespace, engine: str, workers: int) -> dict:
    """One launch: ``workers`` ranks of ``engine`` in a fresh cluster; what rank 0 wrote."""
    from benchmarks.common.netns import Cluster, HorovodJob, TorchJob

    with tempfile.TemporaryDirectory() as tmp, Cluster(workers) as cluster:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "benchmarks.performance.link_bytes", "--worker", "--engine", engine,
                "--json", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
                "--idle", str(args.idle), "--calibration", str(args.calibration), "--ways", *args.ways]
        if args.quick:
            argv.append("--quick")
        env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "900"}
        job_class = HorovodJob if engine == "horovod" else TorchJob
        started = time.monotonic()
        with job_class(cluster, argv, Path(tmp) / "logs", env=env, cwd=REPO) as job:
            job.wait(args.timeout)
        result = json.loads(out.read_text())
    result["namespace_prefix"] = cluster.prefix
    result["duration_s"] = time.monotonic() - started
    return result


def predictions(widths: tuple[int, ...], ways: list[str], workers: int) -> dict[str, dict[str, float]]:
    """The planner's link bytes per rank and step (the mean over the ranks) of each way at ``workers``."""
    from grace_legacy.planner import plan

    shapes = [p.shape for p in build_model(widths).parameters()]
    dense = 2 * (workers - 1) / workers * 4 * sum(s.numel() for s in shapes)
    out = {DENSE: {"link_bytes": dense, "routes": {"dense": len(shapes)}}}
    for way in ways:
        if way == DENSE:
            continue
        compressor, route = split_way(way)
        planned = plan(make_compressor(compressor), shapes, world_size=workers, route=route, dense_fallback=False)
        mean = statistics.fmean(planned.rank_link_bytes(r) for r in range(workers))
        out[way] = {"link_bytes": mean, "link_dense": planned.rank_link_dense(), "routes": planned.routes()}
    return out


def median_of_steps(ranks: list[dict], way: str, value: Callable[[dict], float], reduce: Callable = statistics.fmean
                    ) -> float:
    """Per step, ``value`` of each rank's row reduced over the ranks; the median over the steps."""
    per_step = zip(*(rank["ways"][way]["steps"] for rank in ranks), strict=True)
    return statistics.median(reduce([value(row) for row in rows]) for rows in per_step)


def idle_traffic(rank: dict) -> tuple[float, float]:
    """A rank's background traffic in its idle windows: TCP payload per second and per packet
    (the means of sent and received)."""
    payload = sum((w["tx_payload"] + w["rx_payload"]) / 2 for w in rank["idle"])
    packets = sum((w["tx_packets"] + w["rx_packets"]) / 2 for w in rank["idle"])
    return payload / sum(w["s"] for w in rank["idle"]), payload / packets if packets else 0.0


def charge_overheads(ranks: list[dict], engine: str) -> None:
    """Charge each measured step of each rank what its link carries beyond the collectives' bytes.

    ``coordination``: the background traffic, the smaller of two over-estimates: the idle rate
    times the step's duration (a busy step runs fewer coordination cycles than an idle second) and
    the step's packets times the idle payload per packet (a data packet carries far more than a
    coordination one). ``framing`` (torch.distributed): each call's framing as measured by
    :func:`framing_per_call`, times the step's calls of its kind. Under Horovod that calibration has
    the coordination of its seconds in it, so it is not charged there."""
    for rank in ranks:
        rate, per_packet = idle_traffic(rank)
        for way in rank["ways"].values():
            for row in way["steps"]:
                packets = (row["tx_packets"] + row["rx_packets"]) / 2
                row["coordination"] = min(rate * row["s"], per_packet * packets)
                row["framing"] = 0.0 if engine == "horovod" else sum(
                    count * rank["framing"][kind] for kind, count in row.get("calls", {}).items()
                    if kind in rank.get("framing", {}))


def summarise(result: dict, widths: tuple[int, ...]) -> dict[str, Any]:
    """Per way: the measured, counted and predicted link bytes per rank and step, and their ratios."""
    ranks, workers = result["ranks"], result["workers"]
    ways = list(ranks[0]["ways"])
    predicted = predictions(widths, ways, workers)
    parameters = sum(p.numel() for p in build_model(widths).parameters())
    idle = [idle_traffic(rank) for rank in ranks]
    charge_overheads(ranks, result["engine"])
    rows: dict[str, dict[str, Any]] = {}
    for way in ways:
        link = median_of_steps(ranks, way, lambda r: (r["tx_payload"] + r["rx_payload"]) / 2)
        frames = median_of_steps(ranks, way, lambda r: (r["tx"] + r["rx"]) / 2)
        busiest = median_of_steps(ranks, way, lambda r: max(r["tx_payload"], r["rx_payload"]), max)
        seconds = median_of_steps(ranks, way, lambda r: r["s"])
        coordination = median_of_steps(ranks, way, lambda r: r["coordination"])
        framing = median_of_steps(ranks, way, lambda r: r["framing"])
        data = median_of_steps(ranks, way, lambda r: (r["tx_payload"] + r["rx_payload"]) / 2 - r["coordination"]
                               - r["framing"])
        if way == DENSE:
            collectives = stats = 2 * (workers - 1) / workers * 4 * parameters
            routes = {"dense": len(widths) * 2 - 2}
        else:
            collectives = median_of_steps(ranks, way, lambda r: r["collectives"])
            stats = median_of_steps(ranks, way, lambda r: r["wire_bytes"])
            routes = ranks[0]["ways"][way]["routes"]
        rows[way] = {"link": link, "frames": frames, "busiest": busiest, "step_s": seconds,
                     "coordination": coordination, "framing": framing, "link_less_coordination": data,
                     "collectives": collectives, "stats": stats, "planner": predicted[way]["link_bytes"],
                     "routes": routes, "planned_routes": predicted[way]["routes"]}
    dense = rows[DENSE]
    for row in rows.values():
        row["link_vs_collectives"] = [row["link_less_coordination"] / row["collectives"],
                                      row["link"] / row["collectives"]]
        row["stats_vs_planner"] = row["stats"] / row["planner"]
        row["vs_dense"] = {"link": row["link_less_coordination"] / dense["link_less_coordination"],
                           "link_raw": row["link"] / dense["link"],
                           "planner": row["planner"] / predicted[DENSE]["link_bytes"]}
    framing = {kind: statistics.fmean(rank["framing"][kind] for rank in ranks) for kind in ranks[0].get("framing", {})}
    return {"engine": result["engine"], "workers": workers, "parameters": parameters, "framing": framing,
            "idle_rate": statistics.fmean(rate for rate, _ in idle),
            "idle_per_packet": statistics.fmean(per_packet for _, per_packet in idle), "ways": rows}


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.netns import unavailable_reason
    from benchmarks.common.report import machine

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"benchmarks.performance.link_bytes: {reason}")
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    out: dict[str, Any] = {"machine": machine(), "uptime_before": uptime(), "load_before": os.getloadavg()[0],
                           "widths": list(widths), "runs": []}
    started = time.monotonic()
    for engine in args.engines:
        for workers in args.workers:
            result = run_engine(args, engine, workers)
            result["summary"] = summarise(result, widths)
            out["runs"].append(result)
            print(f"{engine} x{workers}: " + ", ".join(
                f"{way} {row['vs_dense']['link']:.4f}" for way, row in result["summary"]["ways"].items()), flush=True)
    out["uptime_after"], out["load_after"] = uptime(), os.getloadavg()[0]
    out["duration_s"] = time.monotonic() - started
    out["scaling"] = planner_scaling(widths)
    return out


def planner_scaling(widths: tuple[int, ...], counts: tuple[int, ...] = (2, 4, 8, 16, 64, 256, 1024)) -> dict:
    """The planner's ratio to dense of each compressed way, over ``counts`` workers (the plot's lines)."""
    lines = {}
    for way in way_names()[1:]:
        lines[way] = [predictions(widths, [way], p)[way]["link_bytes"] / predictions(widths, [], p)[DENSE]["link_bytes"]
                      for p in counts]
    return {"workers": list(counts), "ratios": lines}


# -- the report ------------------------------------------------------------------------------------

def mb(value: float) -> str:
    return f"{value / 1e6:.4f}" if value < 1e5 else f"{value / 1e6:.3f}"


def verdicts(runs: list[dict]) -> list[str]:
    lines = []
    for run in runs:
        summary = run["summary"]
        if summary["workers"] != TARGET_WORKERS:
            continue
        for compressor, target in TARGETS.items():
            row = summary["ways"].get(f"{compressor} scattergather")
            if row is None:
                continue
            ratio = row["vs_dense"]["link"]
            lines.append(f"- {summary['engine']}, {TARGET_WORKERS} workers, ScatterGather {compressor}: "
                         f"**{ratio:.4f}** of dense's link bytes (raw counters {row['vs_dense']['link_raw']:.4f}, "
                         f"planner {row['vs_dense']['planner']:.4f}): "
                         f"{'meets' if ratio <= target else 'misses'} the target <= {target:g}.")
    return lines


def agreement(runs: list[dict]) -> list[str]:
    """How far the links are from the collectives' count, and the stats from the planner, over all rows."""
    lines = []
    for engine in sorted({run["engine"] for run in runs}):
        rows = [(run["summary"]["workers"], way, row) for run in runs if run["engine"] == engine
                for way, row in run["summary"]["ways"].items()]
        corrected = [row["link_vs_collectives"][0] for _, _, row in rows]
        raw = [row["link_vs_collectives"][1] for _, _, row in rows]
        planner = [row["stats_vs_planner"] for _, _, row in rows]
        outside = [f"{way} at {workers} ({row['link_vs_collectives'][0]:.3f}, {mb(row['collectives'])} MB counted)"
                   for workers, way, row in rows if abs(row["link_vs_collectives"][0] - 1) > 0.05]
        lines.append(f"- {engine}: corrected link / collectives {min(corrected):.4f}-{max(corrected):.4f} "
                     f"(raw counters {min(raw):.4f}-{max(raw):.4f}); stats / planner "
                     f"{min(planner):.6f}-{max(planner):.6f}; beyond 5%: {'; '.join(outside) or 'none'}.")
    return lines


def framing_note(runs: list[dict]) -> str:
    calibrated = [run["summary"] for run in runs if run["engine"] == "torch" and run["summary"]["framing"]]
    if not calibrated:
        return ""
    parts = ", ".join(f"{summary['workers']} workers: " + ", ".join(
        f"{kind} {value:.0f}" for kind, value in summary["framing"].items()) for summary in calibrated)
    return f"Framing per call measured on torch.distributed (bytes per rank): {parts}."


def write(result: dict, results_dir: Path, command: str) -> None:
    results_dir.mkdir(parents=True, exist_ok=True)
    # Compact: every rank's counters of every step are in it.
    (results_dir / "link_bytes.json").write_text(json.dumps(result, separators=(",", ":")))
    head = ("| engine | workers | way | link | frames | background | framing | corrected | collectives | stats "
            "| planner | corrected / collectives (raw) | vs dense, measured | vs dense, planner |\n"
            + "|---" * 14 + "|")
    rows = []
    for run in result["runs"]:
        summary = run["summary"]
        for way, row in summary["ways"].items():
            corrected, raw = row["link_vs_collectives"]
            rows.append(f"| {summary['engine']} | {summary['workers']} | {way} | {mb(row['link'])} | "
                        f"{mb(row['frames'])} | {mb(row['coordination'])} | {mb(row['framing'])} | "
                        f"{mb(row['link_less_coordination'])} | {mb(row['collectives'])} | {mb(row['stats'])} | "
                        f"{mb(row['planner'])} | {corrected:.3f} ({raw:.3f}) | **{row['vs_dense']['link']:.4f}** | "
                        f"{row['vs_dense']['planner']:.4f} |")
    idle = ", ".join(f"{run['engine']} x{run['workers']} {run['summary']['idle_rate'] / 1e3:.1f} kB/s, "
                     f"{run['summary']['idle_per_packet']:.0f} B/packet" for run in result["runs"])
    durations = ", ".join(f"{run['engine']} x{run['workers']} {run['duration_s']:.0f} s" for run in result["runs"])
    parameters = result["runs"][0]["summary"]["parameters"]
    header = result["runs"][0]["ranks"][0]["header_bytes"]
    text = f"""# Link bytes per rank and step, measured on the links

`{command}` (needs root)

Machine: {result['machine']}. Load: `{result['uptime_before']}` before and `{result['uptime_after']}`
after the run ({result['duration_s'] / 60:.0f} minutes: {durations}); other jobs shared the 2 cores. Every
worker ran in its own network namespace on a veth link to a bridge (no rate limit: bytes are the point),
Horovod over Gloo (`hvd.DistributedOptimizer`) and plain torch.distributed over Gloo (DDP,
`grace_legacy.ddp.register`). The model: an MLP of widths {result['widths']} ({parameters:,} parameters,
{2 * len(result['widths']) - 2} tensors, one fused bucket), every way from the same seed, its first steps
not measured. The compressed ways are `Grace(C, communicator=Allgather() or ScatterGather(),
dense_fallback=False)`: every tensor on that route. Dense is Horovod's own allreduce, or DDP's.

Per rank and step, in MB (medians over the measured steps of the means over the ranks):

- *link*: the TCP payload on the rank's interface, the mean of sent and received: the counters'
  frames (*frames*) less {header} header bytes per packet (Ethernet 14, IPv4 20, TCP 20 with its
  12-byte timestamp option; a GSO packet of up to 64 KiB carries one set). Averaged over the ranks
  it is the step's traffic over the ranks, whichever ranks carry more of it;
- *background*: what the links carry with no collective under way, measured while every rank
  slept ({idle}). Horovod's background thread coordinates the ranks every cycle with small
  messages on the same connections; torch.distributed sends next to nothing. A step is charged the
  smaller of two over-estimates: the idle rate times the step's duration (a step on 2 shared cores
  runs fewer coordination cycles than an idle second), and its packets times the idle payload per
  packet (a data packet carries more than a coordination one). The second also takes a like amount
  off every data packet, so under Horovod it absorbs each message's framing;
- *framing* (torch.distributed): what one call of each kind puts on the link beyond its counted
  bytes, measured with one-element calls (the sizes exchanged before a gather or an all-to-all, and
  Gloo's header on each message), times the step's calls of that kind. {framing_note(result['runs'])}
- *corrected*: *link - background - framing*;
- *collectives*: what grace_legacy's backend handed to the engine, as link bytes with
  bandwidth-optimal algorithms (allreduce `2(P-1)/P x B`, allgather the other ranks' parts,
  all-to-all the parts sent to others), counted by wrapping the backend: the step's `wire_bytes`
  plus the per-step inf/NaN flags' allreduce; for dense a ring allreduce of the gradients;
- *stats*: the step's `stats["wire_bytes"]`; *planner*: `grace_legacy.planner.plan(C, shapes,
  world_size=P, route=R, dense_fallback=False)`, the mean over the ranks of `rank_link_bytes(r)`;
- *vs dense*: the way's corrected link bytes over dense's (the planner's over the planner's).

{head}
{chr(10).join(rows)}

**Targets at {TARGET_WORKERS} workers** (ScatterGather's link bytes over dense allreduce's):

{chr(10).join(verdicts(result['runs'])) or '- (no run at 16 workers)'}

**Agreement** (the issue asks for 5%, TCP and Horovod's coordination aside):

{chr(10).join(agreement(result['runs']))}

![link bytes against workers](link_bytes.png)
"""
    (results_dir / "link_bytes.md").write_text(text)
    plot(result, results_dir / "link_bytes.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"QSGD(127)": "#a5a", "SignSGD": "#c44", "Top-k 0.01": "#36b", "Top-k 0.001": "#2a2"}
    figure, axis = plt.subplots(figsize=(8, 5))
    scaling = result["scaling"]
    for way, ratios in scaling["ratios"].items():
        compressor, route = split_way(way)
        style = "-" if route == "scattergather" else ":"
        axis.plot(scaling["workers"], ratios, style, color=colours[compressor], alpha=0.6,
                  label=f"{compressor} {route} (planner)")
    markers = {"horovod": "o", "torch": "s"}
    for run in result["runs"]:
        summary = run["summary"]
        for way, row in summary["ways"].items():
            if way == DENSE:
                continue
            compressor, route = split_way(way)
            axis.scatter([summary["workers"]], [row["vs_dense"]["link"]], marker=markers[summary["engine"]],
                         facecolors=colours[compressor] if route == "scattergather" else "none",
                         edgecolors=colours[compressor], zorder=3)
    axis.axhline(1.0, color="black", linewidth=1, label="dense ring allreduce")
    for engine, marker in markers.items():
        axis.scatter([], [], marker=marker, facecolors="gray", edgecolors="gray",
                     label=f"measured on the links, {engine} (hollow: allgather)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(scaling["workers"], [str(p) for p in scaling["workers"]])
    axis.set_yscale("log")
    axis.set_xlabel("workers")
    axis.set_ylabel("link bytes per rank / dense allreduce's")
    axis.set_title(f"Link bytes per rank and step, MLP of {result['runs'][0]['summary']['parameters'] / 1e6:.2f}M "
                   f"parameters")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 workers, a tiny model, one step")
    parser.add_argument("--workers", type=int, nargs="+", default=None)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--ways", nargs="+", default=way_names(), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help="measured steps per way")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per way first")
    parser.add_argument("--idle", type=float, default=None, help="seconds of each idle window")
    parser.add_argument("--calibration", type=int, default=20, help="calls per kind measuring the framing")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before a launch's workers are stopped")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--from-json", type=Path, help="only write the report again, from a run's link_bytes.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers is None:
        args.workers = list(QUICK_WORKER_COUNTS if args.quick else WORKER_COUNTS)
    if args.steps is None:
        args.steps = 1 if args.quick else 3
    if args.idle is None:
        args.idle = 0.3 if args.quick else 2.0
    if args.quick:
        args.warmup = min(args.warmup, 1)
    if args.worker:
        worker(args)
        return
    from benchmarks.common.limited_link import reproducing_options

    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
        for run in result["runs"]:
            run["summary"] = summarise(run, tuple(result["widths"]))
        command = result["command"]
    else:
        result = launch(args)
        command = " ".join(["python -m benchmarks.performance.link_bytes", *reproducing_options(sys.argv[1:])])
        result["command"] = command
    write(result, args.results, command)
    print(f"wrote {args.results / 'link_bytes.md'}")


if __name__ == "__main__":
    main()
