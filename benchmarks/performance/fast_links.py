"""DDP hooks on a fast link: grace_legacy's against PyTorch's on loopback, no rate limit, paired step by step.

    python -m benchmarks.performance.fast_links            # the full run (about 30 minutes on 2 cores)
    python -m benchmarks.performance.fast_links --quick    # a smoke run with tiny models
    python -m benchmarks.performance.fast_links --models fc   # one model shape

Four ``torchrun`` workers (Gloo over loopback, ``env://``; no namespaces, no root) train the same
model wrapped in ``DistributedDataParallel``, one DDP instance per way, all from the same seed, for
each of three shapes (:data:`MODELS`): *conv*, ResNet-18's layout at a quarter of its widths
(:class:`~benchmarks.common.step_models.ResNetLike`, 2.8M parameters in 62 tensors, batch 16 of
3 x 32 x 32); *fc*, two small convolutions and a 4096 x 512 fully connected layer
(:class:`~benchmarks.common.step_models.DenseHeadCNN`, 2.1M parameters, most in one matrix, batch
16); *transformer*, four pre-norm blocks of width 256 with a 2048-word embedding and head
(:class:`~benchmarks.common.step_models.TransformerLike`, 4.2M parameters, batch 4 x 64 tokens). On
such a link communication costs little, so what a hook does on the CPU decides the step (the regime
of a fast interconnect):

* *allreduce*: DDP's own allreduce (no hook), the floor;
* *torch fp16* (``fp16_compress_hook``) against *grace FP16* (``grace_legacy.ddp.register(ddp, FP16())``);
* PyTorch's ``powerSGD_hook`` three ways: *at its defaults* (``PowerSGDState(process_group)`` and
  nothing else: rank 1, ``min_compression_rate=2``, error feedback and warm start) past its first
  ``start_powerSGD_iter=1000`` steps, as in a run beyond step 1,000 (its step counter is set
  there; one bucket, see below); the same *in its warm-up*, the plain allreduces those first
  1,000 steps are (what a user of the defaults gets in a run as short as this one, so the ratio
  is ours against a dense allreduce, shown without a target); and *matched*
  (``matrix_approximation_rank=2``, error feedback and warm start on,
  ``min_compression_rate=1`` so that it factors what ours factors, factoring from the second
  step); against *grace PowerSGD* (``register(ddp, PowerSGD(2))``, each round one allreduce for
  every bucket), and *grace PowerSGD per bucket* (``fuse_rounds=False``: each bucket's first round
  launched as it arrives) for comparison. PyTorch's hook hangs or aborts on Gloo with more than one
  bucket once it factors (its later rounds start from future callbacks), so its two factoring ways
  get one bucket; the others run with DDP's default buckets.

Each iteration runs every way once, in an order that reverses from one iteration to the next, each
step after a barrier and timed from forward to the end of ``optimizer.step()``; the slowest rank's
time counts. A ratio is *theirs / ours* for the same iteration (above 1: ours is faster), so a
slow spell of the machine weighs on both sides. The run is cut into ``--repeats`` blocks; each
block's median ratio is one repeat, and the report gives the median over the repeats with their
range (the spread).

Then one more process profiles each hook on a one-rank group (no network; what remains is the
hook's own work): torch's operator counts per step (load-insensitive) for every way, and for
ours a cProfile of the hook split by part: hook entry and exit (DDP's bucket to parcels and the
results back into the bucket), the bundle's per-tensor bookkeeping, compress, decompress, memory,
fusion (packing, concatenating, splitting), non-finite checks, traffic accounting, collective
launch and wait, for each model. Results: ``benchmarks/results/performance.md`` (section "fast_links"),
``fast_links.json``, ``fast_links.png``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.report import REPO, load_average, machine, median_interval, write_report
from benchmarks.common.worker_exit import end_worker

WORKERS = 4
POWERSGD_RANK = 2
# The least start_powerSGD_iter PyTorch accepts with error feedback or warm start.
TORCH_POWERSGD_START = 2
# Above the model's gradient size: DDP puts every gradient in one bucket.
ONE_BUCKET_MB = 1024
WIDTHS, QUICK_WIDTHS = (32, 64, 128, 256), (8, 16, 32, 64)
BATCH, QUICK_BATCH = 16, 4
#: The model shapes, each timed in a launch of its own.
MODELS = ("conv", "fc", "transformer")

ALLREDUCE, TORCH_FP16, GRACE_FP16 = "allreduce", "torch fp16", "grace FP16"
TORCH_POWERSGD_DEFAULTS, TORCH_POWERSGD = "torch PowerSGD at defaults", "torch PowerSGD matched"
TORCH_POWERSGD_WARMUP = "torch PowerSGD at defaults, warm-up"
GRACE_POWERSGD, GRACE_POWERSGD_PER_BUCKET = "grace PowerSGD", "grace PowerSGD per bucket"
WAYS = (ALLREDUCE, TORCH_FP16, GRACE_FP16, TORCH_POWERSGD_DEFAULTS, TORCH_POWERSGD_WARMUP, TORCH_POWERSGD,
        GRACE_POWERSGD, GRACE_POWERSGD_PER_BUCKET)
#: PyTorch's PowerSGD ways that factor, which on Gloo need every gradient in one bucket.
ONE_BUCKET_WAYS = (TORCH_POWERSGD_DEFAULTS, TORCH_POWERSGD)
#: (ours, theirs) and the target ratio theirs / ours (issues #35 and #46; None: shown for comparison)
PAIRS = {"FP16": (GRACE_FP16, TORCH_FP16, 0.98),
         "PowerSGD vs the hook at its defaults": (GRACE_POWERSGD, TORCH_POWERSGD_DEFAULTS, 1.0),
         "PowerSGD vs the hook's warm-up (an allreduce)": (GRACE_POWERSGD, TORCH_POWERSGD_WARMUP, None),
         "PowerSGD vs the hook matched": (GRACE_POWERSGD, TORCH_POWERSGD, 1.0),
         "PowerSGD per bucket vs matched": (GRACE_POWERSGD_PER_BUCKET, TORCH_POWERSGD, None)}

#: grace_legacy's code by part: (file under grace_legacy/, function name or "*") -> part, first match wins.
PARTS = (
    (("ddp.py", "*"), "hook entry and exit"),
    (("step_guard.py", "*"), "non-finite checks"),
    (("consistency.py", "*"), "rank agreement checks"),
    (("runtime/traffic.py", "*"), "traffic accounting"),
    (("runtime/cost.py", "*"), "traffic accounting"),
    (("backends/torch_distributed.py", "wait"), "collective wait"),
    (("backends/torch_distributed.py", "result"), "collective wait"),
    (("backends/torch_distributed.py", "*"), "collective launch"),
    (("runtime/lending.py", "*"), "collective launch"),
    (("communicators/", "*"), "fusion (pack, concatenate, split)"),
    (("runtime/wire.py", "*"), "fusion (pack, concatenate, split)"),
    (("runtime/buffers.py", "*"), "fusion (pack, concatenate, split)"),
    (("memories/", "*"), "memory (error feedback)"),
    (("core/memory.py", "*"), "memory (error feedback)"),
    (("compressors/", "decompress"), "decompress"),
    (("compressors/", "aggregate"), "decompress"),
    (("compressors/", "end_exchange"), "decompress"),
    (("compressors/", "*"), "compress"),
    (("core/compressor.py", "*"), "compress"),
    (("", "*"), "bundle (per-tensor bookkeeping)"),
)


# -- the ways ---------------------------------------------------------------------------------------------

def build_model(shape: str, quick: bool, data_seed: int) -> tuple[Any, Any, Any]:
    """(model, inputs, targets) of model shape ``shape`` (:data:`MODELS`), weights from seed 0."""
    import torch

    from benchmarks.common.step_models import DenseHeadCNN, ResNetLike, TransformerLike

    torch.manual_seed(0)
    data = torch.Generator().manual_seed(data_seed)
    batch = QUICK_BATCH if quick else BATCH
    if shape == "transformer":
        vocab, width, layers, context, batch = (256, 32, 2, 16, 2) if quick else (2048, 256, 4, 64, 4)
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=data)
        return TransformerLike(vocab, width, layers, heads=4, context=context), tokens[:, :-1], tokens[:, 1:]
    images, labels = torch.randn(batch, 3, 32, 32, generator=data), torch.randint(0, 10, (batch,), generator=data)
    if shape == "fc":
        return DenseHeadCNN((8, 16), 64) if quick else DenseHeadCNN(), images, labels
    if shape == "conv":
        return ResNetLike(QUICK_WIDTHS if quick else WIDTHS), images, labels
    raise ValueError(f"fast_links: model must be one of {MODELS}, got {shape!r}")


def build_way(name: str, shape: str, quick: bool, group: Any, data_seed: int) -> tuple[Any, Any]:
    """(step function, hook state) of way ``name`` on model ``shape``; a collective on ``group``
    (every rank, same order)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import grace_legacy.ddp
    from grace_legacy import FP16, PowerSGD

    model, inputs, targets = build_model(shape, quick, data_seed)
    ddp = DistributedDataParallel(model, process_group=group,
                                  bucket_cap_mb=ONE_BUCKET_MB if name in ONE_BUCKET_WAYS else None)
    state: Any = None
    if name == TORCH_FP16:
        ddp.register_comm_hook(group, fp16_compress_hook)
    elif name == GRACE_FP16:
        state = grace_legacy.ddp.register(ddp, FP16())
    elif name in (TORCH_POWERSGD_DEFAULTS, TORCH_POWERSGD_WARMUP):
        state = PowerSGDState(process_group=group)
        if name == TORCH_POWERSGD_DEFAULTS:
            state.iter = state.start_powerSGD_iter  # past its plain allreduces, as after step 1,000
        ddp.register_comm_hook(state, powerSGD_hook)
    elif name == TORCH_POWERSGD:
        state = PowerSGDState(process_group=group, matrix_approximation_rank=POWERSGD_RANK,
                              start_powerSGD_iter=TORCH_POWERSGD_START, min_compression_rate=1,
                              use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook)
    elif name == GRACE_POWERSGD:
        state = grace_legacy.ddp.register(ddp, PowerSGD(POWERSGD_RANK))
    elif name == GRACE_POWERSGD_PER_BUCKET:
        state = grace_legacy.ddp.register(ddp, PowerSGD(POWERSGD_RANK), fuse_rounds=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad()
        out = ddp(inputs)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1)).backward()
        optimizer.step()

    return step, state


def build_ways(shape: str, quick: bool, group: Any, data_seed: int) -> dict[str, Any]:
    """Every way's step, PyTorch's matched PowerSGD past its plain-allreduce steps and every way warmed up."""
    steps = {name: build_way(name, shape, quick, group, data_seed)[0] for name in WAYS}
    for _ in range(TORCH_POWERSGD_START):
        steps[TORCH_POWERSGD]()
    for step in steps.values():
        step()
    return steps


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    steps = build_ways(args.model, args.quick, None, rank)
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for iteration in range(args.steps):
        for name in WAYS if iteration % 2 == 0 else tuple(reversed(WAYS)):
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    # The slowest rank decides when a step is over.
    slowest = torch.tensor([times[name] for name in WAYS], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args.json).write_text(json.dumps({name: row for name, row in zip(WAYS, slowest.tolist(), strict=True)}))
    end_worker()  # PyTorch's own DDP collectives can abort a finalizing interpreter


# -- the profile on one rank ------------------------------------------------------------------------------

def part_of(filename: str, function: str) -> str | None:
    """The part of grace_legacy's code that ``function`` of ``filename`` belongs to (``None``: not ours)."""
    package = f"{os.sep}grace_legacy{os.sep}"
    if package not in filename:
        return None
    inside = filename.split(package, 1)[1].replace(os.sep, "/")
    for (where, name), part in PARTS:
        if inside.startswith(where) and name in ("*", function):
            return part
    raise AssertionError("the last rule matches everything")


def split_by_part(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Seconds per step of grace_legacy's code by part: a function of ours counts its own time; a
    function outside (a torch operator, ``torch.distributed``) counts, whole, for the part of ours
    that called it."""
    parts: collections.Counter[str] = collections.Counter()
    for (filename, _, function), (_, _, own, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        part = part_of(filename, function)
        if part is not None:
            parts[part] += own
            continue
        for (caller_file, _, caller), edge in callers.items():
            caller_part = part_of(caller_file, caller)
            if caller_part is not None:
                parts[caller_part] += edge[3]  # the time spent under this call edge
    return {part: seconds / steps for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1])}


def profile_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    steps = build_ways(args.model, args.quick, None, 0)
    repeats = args.profile_steps
    result: dict[str, Any] = {"steps": repeats, "ops": {}, "parts_s": {}, "step_s": {}}
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                step()
        counts: collections.Counter[str] = collections.Counter(event.name for event in prof.events())
        result["ops"][name] = {op: count / repeats for op, count in counts.items()}
    for name in (GRACE_FP16, GRACE_POWERSGD):
        # This thread's CPU time (the hook runs in the thread that runs backward): what other
        # processes take of the cores does not count, so the parts hold still under load.
        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        for _ in range(repeats):
            steps[name]()
        profiler.disable()
        result["parts_s"][name] = split_by_part(pstats.Stats(profiler), repeats)
    # Step times on one rank, interleaved (noisy; the counts above are not), and the CPU time of
    # the thread running backward spent in our hook (its entry for every bucket, the whole step's
    # exchange at the last): what the hook costs a rank, less sensitive to the load than a step.
    import grace_legacy.ddp

    hooked, spent = grace_legacy.ddp.GraceState.exchange, [0.0]

    def timed_exchange(state: Any, bucket: Any) -> Any:
        begin = time.thread_time()
        try:
            return hooked(state, bucket)
        finally:
            spent[0] += time.thread_time() - begin

    grace_legacy.ddp.GraceState.exchange = timed_exchange  # type: ignore[method-assign]
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    hook: dict[str, list[float]] = {name: [] for name in (GRACE_FP16, GRACE_POWERSGD)}
    for iteration in range(repeats):
        for name in WAYS if iteration % 2 == 0 else tuple(reversed(WAYS)):
            spent[0] = 0.0
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
            if name in hook:
                hook[name].append(spent[0])
    grace_legacy.ddp.GraceState.exchange = hooked  # type: ignore[method-assign]
    result["step_s"] = {name: statistics.median(row) for name, row in times.items()}
    result["hook_cpu_s"] = {name: statistics.median(row) for name, row in hook.items()}
    Path(args.json).write_text(json.dumps(result))
    end_worker()


# -- the driver -------------------------------------------------------------------------------------------

def torchrun(workers: int, *options: str) -> Any:
    import socket

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        out = Path(tmp) / "workers.json"
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(workers),
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "benchmarks.performance.fast_links", "--json", str(out), *options]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, cwd=REPO, env=env, timeout=3600)
        return json.loads(out.read_text())


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"load average {load_average():.2f}"


def ratios(times: dict[str, list[float]], repeats: int) -> dict[str, dict[str, Any]]:
    """Per pair: the per-iteration ratios theirs / ours, cut into ``repeats`` blocks; each block's
    median, the median of those, their range and the 95% interval of the median over all iterations."""
    out = {}
    for pair, (ours, theirs, target) in PAIRS.items():
        paired = [their / our for our, their in zip(times[ours], times[theirs], strict=True)]
        size = max(1, len(paired) // repeats)
        blocks = [statistics.median(paired[i:i + size]) for i in range(0, size * repeats, size) if paired[i:i + size]]
        out[pair] = {"ours": ours, "theirs": theirs, "target": target, "per_repeat": blocks,
                     "median": statistics.median(blocks), "range": [min(blocks), max(blocks)],
                     "interval": list(median_interval(paired)),
                     "met": None if target is None else statistics.median(blocks) >= target}
    return out


def launch(args: argparse.Namespace) -> dict:
    before = uptime()
    load_before = load_average()
    models = {}
    for shape in args.models:
        common = ["--model", shape] + (["--quick"] if args.quick else [])
        times = torchrun(WORKERS, "--worker", "--steps", str(args.steps), *common)
        profile = torchrun(1, "--profile-worker", "--profile-steps", str(args.profile_steps), *common)
        model = build_model(shape, args.quick, 0)[0]
        models[shape] = {"parameters": sum(p.numel() for p in model.parameters()),
                         "largest": max(p.numel() for p in model.parameters()),
                         "tensors": sum(1 for _ in model.parameters()), "times_s": times,
                         "ratios": ratios(times, args.repeats), "profile": profile}
    return {"machine": machine(), "uptime": [before, uptime()], "load_average": [load_before, load_average()],
            "workers": WORKERS, "steps": args.steps, "repeats": args.repeats, "quick": args.quick, "models": models}


OPS_SHOWN = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::clone", "aten::aminmax", "aten::isfinite",
             "aten::div_", "aten::empty", "aten::mm", "aten::linalg_qr")


def collectives(ops: dict[str, float]) -> float:
    return sum(count for op, count in ops.items() if op.startswith("c10d::") and not op.startswith("c10d::barrier"))


MODEL_TEXT = {
    "conv": "ResNet-like CNN (ResNet-18's layout at a quarter of its widths)",
    "fc": "CNN with a 4096 x 512 fully connected layer",
    "transformer": "four transformer blocks of width 256, 2048-word embedding and head",
}


def model_section(shape: str, run: dict, steps: int, repeats: int) -> str:
    """The tables of one model shape: verdicts, step times, operator counts, our hook by part."""
    times, profile = run["times_s"], run["profile"]
    lines = ["| way | step ms (median, 95% interval) | vs allreduce |", "|---|---|---|"]
    floor = statistics.median(times[ALLREDUCE])
    for name in WAYS:
        low, high = median_interval(times[name])
        med = statistics.median(times[name])
        lines.append(f"| {name} | {1e3 * med:.1f} ({1e3 * low:.1f}-{1e3 * high:.1f}) | {med / floor:.2f}x |")
    verdicts = []
    for pair, r in run["ratios"].items():
        verdicts.append(
            f"- **{pair}**: {r['theirs']} / {r['ours']} = **{r['median']:.3f}x** (median of {len(r['per_repeat'])} "
            f"repeats' medians; range {r['range'][0]:.3f}-{r['range'][1]:.3f}; 95% interval of the median over "
            f"all iterations {r['interval'][0]:.3f}-{r['interval'][1]:.3f}); "
            + ("for comparison (no target)." if r["target"] is None else
               f"target >= {r['target']}: {'met' if r['met'] else 'not met'}."))
    ops_rows = ["| way | aten ops | " + " | ".join(op.removeprefix("aten::") for op in OPS_SHOWN)
                + " | collectives | one-rank step ms |", "|---|" + "---|" * (len(OPS_SHOWN) + 3)]
    for name in WAYS:
        ops = profile["ops"][name]
        aten = sum(count for op, count in ops.items() if op.startswith("aten::"))
        ops_rows.append(f"| {name} | {aten:.0f} | " + " | ".join(f"{ops.get(op, 0):.0f}" for op in OPS_SHOWN)
                        + f" | {collectives(ops):.0f} | {1e3 * profile['step_s'][name]:.1f} |")
    part_rows = ["| part | " + " | ".join(profile["parts_s"]) + " |", "|---|" + "---|" * len(profile["parts_s"])]
    all_parts = sorted({p for parts in profile["parts_s"].values() for p in parts},
                       key=lambda p: -sum(parts.get(p, 0) for parts in profile["parts_s"].values()))
    for part in all_parts:
        part_rows.append(f"| {part} | " + " | ".join(f"{1e3 * parts.get(part, 0):.2f}"
                                                   for parts in profile["parts_s"].values()) + " |")
    part_rows.append("| **total** | " + " | ".join(f"**{1e3 * sum(parts.values()):.2f}**"
                                                  for parts in profile["parts_s"].values()) + " |")
    hook_cpu = ", ".join(f"{name} {1e3 * seconds:.2f} ms" for name, seconds in profile["hook_cpu_s"].items())
    nl = "\n"
    return f"""### {shape}: {MODEL_TEXT[shape]}

{run['parameters']:,} parameters in {run['tensors']} tensors (the largest {run['largest']:,}); {steps}
iterations, a repeat is the median over a block of {steps // repeats}.

{nl.join(verdicts)}

{nl.join(lines)}

Where the time goes, one rank (no network), {profile['steps']} steps per way: torch's operator counts
per step (load-insensitive; `collectives` counts `c10d::` operators, barriers excluded) and the step time.

{nl.join(ops_rows)}

grace_legacy's hook by part, CPU ms of the step's thread per step on one rank (cProfile on the
thread's CPU clock, whose own overhead inflates Python-heavy parts; a torch operator counts for the
part of ours that called it):

{nl.join(part_rows)}

CPU time of the thread running backward spent in our hook per step (thread clock, no profiler;
median over {profile['steps']} steps): {hook_cpu}.
"""


def write(result: dict, results_dir: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    summary = ["| model | " + " | ".join(PAIRS) + " |", "|---|" + "---|" * len(PAIRS)]
    for shape, run in models.items():
        summary.append(f"| {shape} | " + " | ".join(
            f"{r['median']:.3f}x ({r['range'][0]:.3f}-{r['range'][1]:.3f})"
            + ("" if r["target"] is None else f", {'met' if r['met'] else 'not met'}")
            for r in run["ratios"].values()) + " |")
    nl = "\n"
    sections = nl.join(model_section(shape, run, result["steps"], result["repeats"]) for shape, run in models.items())
    section = f"""## DDP hooks on a fast link: grace_legacy's against PyTorch's (loopback, no rate limit)

`{command}`

Machine: {result['machine']}; `uptime` before: `{result['uptime'][0]}`; after: `{result['uptime'][1]}`.
{result['workers']} torchrun workers, Gloo over loopback, one thread each; one DDP instance per way,
each way once per iteration in an order reversing every iteration, each step after a barrier, the
slowest rank's time. PyTorch's PowerSGD *at its defaults* is `PowerSGDState(process_group)` alone
(rank 1, `min_compression_rate=2`, error feedback, warm start) past its first 1,000 steps (its step
counter set there), *warm-up* the same in those steps, which are plain allreduces (no target: that
is ours against a dense allreduce); *matched* is rank 2, error feedback and warm start,
`min_compression_rate=1`, factoring from the second step. Both factoring ways have one bucket
(PyTorch's hook breaks on Gloo with more). Ours run with DDP's default buckets; grace PowerSGD sends each round
once for all buckets (`fuse_rounds`, the default), per bucket (`fuse_rounds=False`) each bucket's
first round as it arrives. A ratio is theirs / ours in the same iteration (above 1: ours faster):
median over the repeats (range over the repeats).

{nl.join(summary)}

{sections}"""
    write_report(results_dir, "fast_links", result, section)
    figure, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False, sharey=True)
    for axis, (shape, run) in zip(axes[0], models.items(), strict=True):
        names = list(run["ratios"])
        medians = [run["ratios"][n]["median"] for n in names]
        spread = [[m - run["ratios"][n]["range"][0] for n, m in zip(names, medians, strict=True)],
                  [run["ratios"][n]["range"][1] - m for n, m in zip(names, medians, strict=True)]]
        axis.bar(range(len(names)), medians, yerr=spread, capsize=5,
                 color=["tab:blue", "tab:orange", "tab:olive", "tab:green", "tab:gray"][:len(names)])
        for index, name in enumerate(names):
            if run["ratios"][name]["target"] is not None:
                axis.hlines(run["ratios"][name]["target"], index - 0.4, index + 0.4, colors="black",
                            linestyles="dashed")
        labels = {"PowerSGD vs the hook at its defaults": "PowerSGD vs\nits defaults",
                  "PowerSGD vs the hook's warm-up (an allreduce)": "PowerSGD vs\nits warm-up",
                  "PowerSGD vs the hook matched": "PowerSGD vs\nmatched", "PowerSGD per bucket vs matched":
                  "per bucket vs\nmatched"}
        axis.set_xticks(range(len(names)), [labels.get(n, n) for n in names], fontsize=7)
        axis.set_title(shape, fontsize=9)
    axes[0][0].set_ylabel("PyTorch's step / ours (above 1: ours faster)")
    figure.suptitle(f"DDP hooks, {result['workers']} ranks on loopback (range over repeats; dashed: target)",
                    fontsize=9)
    figure.tight_layout()
    figure.savefig(results_dir / "fast_links.png", dpi=120)
    plt.close(figure)


def main() -> None:
    from benchmarks.common.report import benchmark_parser

    parser = benchmark_parser(__doc__)
    parser.add_argument("--steps", type=int, default=None, help="timed iterations (each runs every way once)")
    parser.add_argument("--repeats", type=int, default=None, help="blocks the iterations are cut into")
    parser.add_argument("--profile-steps", type=int, default=None, help="steps per way in the one-rank profile")
    parser.add_argument("--profile-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, default="conv", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="model shapes to time")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 4 if args.quick else 120
    if args.repeats is None:
        args.repeats = 2 if args.quick else 6
    if args.profile_steps is None:
        args.profile_steps = 2 if args.quick else 20
    if args.worker:
        worker(args)
        return
    if args.profile_worker:
        profile_worker(args)
        return
    result = launch(args)
    write(result, args.results, "python -m benchmarks.performance.fast_links"
          + (" --quick" if args.quick else "") + (f" --steps {args.steps}" if args.steps != 120 and not args.quick
                                                   else "")
          + ("" if list(args.models) == list(MODELS) else " --models " + " ".join(args.models)))
    print(json.dumps({shape: {pair: {k: r[k] for k in ("median", "range", "met")} for pair, r in run["ratios"].items()}
                      for shape, run in result["models"].items()}, indent=1))


if __name__ == "__main__":
    main()
