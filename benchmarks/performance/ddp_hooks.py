"""DDP communication hooks side by side, bandwidth-limited: PyTorch's own vs grace_legacy's.

    python -m benchmarks.performance.ddp_hooks            # the full run (about 20 minutes on 2 cores)
    python -m benchmarks.performance.ddp_hooks --quick    # a smoke run with tiny models

Needs root: four plain ``torch.distributed`` workers (Gloo over TCP, ``env://`` rendezvous, as
``torchrun`` starts one process per host) run each in its own Linux network namespace, on links
rate limited in both directions (:mod:`benchmarks.common.netns`); the rate changes between
phases while they keep running (:mod:`benchmarks.common.limited_link`).

Every worker trains the same models (:mod:`benchmarks.common.step_models`) wrapped in
``DistributedDataParallel``, one DDP instance per way (its own buckets and hook state), all from
the same seed, interleaved step by step:

* *compute only*: the bare model, no communication (the lower bound's compute);
* *allreduce*: DDP's own allreduce (no hook);
* *torch fp16* (``fp16_compress_hook``) and *grace FP16* (``grace_legacy.ddp.register(ddp, FP16())``);
* *torch PowerSGD* (``PowerSGDState`` + ``powerSGD_hook``) and *grace PowerSGD*
  (``register(ddp, PowerSGD(rank))``, with its error feedback) at the same rank. PyTorch's state is
  set to send what ours sends: ``min_compression_rate=1`` (factor a matrix whenever its factors are
  smaller, as ours does; the default 2 sends more matrices dense), error feedback and warm start on,
  and ``start_powerSGD_iter=2`` (the least PyTorch allows with them; its first two steps are plain
  allreduces, run before timing). PyTorch's hook runs its later rounds from the futures' callbacks,
  which with Gloo and more than one DDP bucket hangs or aborts, so both PowerSGD ways get one DDP
  bucket (``bucket_cap_mb`` above the model's size): the same DDP set-up, only the hook differs;
* *grace Top-k + EF*: ``register(ddp, Grace(TopK(0.001), memory=Residual()))``.

A step is timed from forward to the end of ``optimizer.step()``, on every rank after a barrier;
the slowest rank counts. *Payload*: the bytes a rank hands to ``torch.distributed`` per step,
counted by wrapping its collectives (PyTorch's hooks call them as ours do; DDP's own allreduce
runs in C++, so its payload is the gradients' size). *Wire*: what those collectives must put on
each rank's link (``2 (P-1)/P x`` allreduced, ``(P-1) x`` allgathered, ``(P-1)/P x`` broadcast
bytes); the lower bound is ``compute + wire / rate`` and each step is held to the bound of its own
iteration. *Link*: bytes seen on the busiest link (interface counters: headers included).
*Local cost*: each way's step on a one-rank process group (same hook, no network) minus the
compute-only step of the same iteration, all ranks at once: DDP's bucket copies and the hook's own
work. Results: ``benchmarks/results/performance.md`` (section "ddp_hooks"), ``ddp_hooks.json``,
``ddp_hooks.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import limited_link
from benchmarks.common.ddp_hooks_report import (
    ALLREDUCE,
    GRACE_FP16,
    GRACE_POWERSGD,
    TOPK,
    TORCH_FP16,
    TORCH_POWERSGD,
    WAYS,
    summary,
    write,
)
from benchmarks.common.limited_link import (
    COMPUTE,
    interleave,
    label,
    plan_steps,
    request_rate,
    ring_allreduce_bytes,
    timed_on_link,
)
from benchmarks.common.worker_exit import end_worker

WORKERS = 4
DENSITY = 0.001
POWERSGD_RANK = 4
# The least start_powerSGD_iter PyTorch accepts with error feedback or warm start.
TORCH_POWERSGD_START = 2
# Above either model's gradient size: DDP puts every gradient in one bucket.
ONE_BUCKET_MB = 1024
LEARNING_RATE = 1e-3


# -- counting what the hooks hand to torch.distributed --------------------------------------------------

class CollectiveCounter:
    """Wraps ``torch.distributed``'s collectives (and the gather grace_legacy's backend bound at
    import) to count, per rank, the calls, the payload bytes and the wire bytes they need.

    PyTorch's PowerSGD hook issues its later rounds from future callbacks on another thread, hence
    the lock. The harness's own collectives run inside :meth:`paused`.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.payload = 0.0
        self.wire = 0.0
        self.counting = True
        self._lock = threading.Lock()

    def snapshot(self) -> tuple[int, float, float]:
        return self.calls, self.payload, self.wire

    def _add(self, payload: float, wire: float) -> None:
        if self.counting:
            with self._lock:
                self.calls += 1
                self.payload += payload
                self.wire += wire

    def install(self) -> CollectiveCounter:
        import torch.distributed as dist

        from grace_legacy.backends import torch_distributed

        def size_of(group: Any) -> int:
            return dist.get_world_size(group if group is not None else dist.group.WORLD)

        def nbytes(tensor: Any) -> int:
            return tensor.numel() * tensor.element_size()

        all_reduce, broadcast, gather = dist.all_reduce, dist.broadcast, torch_distributed._gather_into_tensor

        def counted_all_reduce(tensor: Any, *args: Any, group: Any = None, **kwargs: Any) -> Any:
            self._add(nbytes(tensor), ring_allreduce_bytes(nbytes(tensor), size_of(group)))
            return all_reduce(tensor, *args, group=group, **kwargs)

        def counted_broadcast(tensor: Any, *args: Any, group: Any = None, **kwargs: Any) -> Any:
            size = size_of(group)
            self._add(nbytes(tensor), nbytes(tensor) * (size - 1) / size)
            return broadcast(tensor, *args, group=group, **kwargs)

        def counted_gather(out: Any, tensor: Any, *args: Any, group: Any = None, **kwargs: Any) -> Any:
            self._add(nbytes(tensor), nbytes(tensor) * (size_of(group) - 1))
            return gather(out, tensor, *args, group=group, **kwargs)

        dist.all_reduce, dist.broadcast = counted_all_reduce, counted_broadcast
        torch_distributed._gather_into_tensor = counted_gather
        return self


def powersgd_elements(model: Any, rank: int, min_compression_rate: float) -> tuple[int, int]:
    """(elements sent dense, elements of P and Q) per step by PowerSGD at ``rank`` as PyTorch's hook
    documents it: each gradient viewed as ``shape[0] x rest``, factored when ``(n + m) r x
    min_compression_rate < n m`` (with ``r`` at most ``min(n, m)``), sent whole otherwise."""
    dense = factors = 0
    for parameter in model.parameters():
        n = parameter.shape[0]
        m = parameter.numel() // n
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            factors += (n + m) * r
        else:
            dense += n * m
    return dense, factors


# -- the workers ------------------------------------------------------------------------------------------

@dataclass
class Way:
    name: str
    step_model: Any
    optimizer: Any
    state: Any = None

    def step(self) -> float:
        """One training step; returns when its backward pass ended (DDP has waited for every
        bucket's future by then)."""
        self.optimizer.zero_grad()
        self.step_model.loss().backward()
        backward_done = time.perf_counter()
        self.optimizer.step()
        return backward_done


def build_way(name: str, model: str, quick: bool, group: Any, rank: int) -> Way:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import grace_legacy.ddp
    from benchmarks.common.step_models import build
    from grace_legacy import FP16, Grace, PowerSGD, Residual, TopK

    step_model = build(model, quick, seed=0, data_seed=rank)
    optimizer = torch.optim.SGD(step_model.model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    if name == COMPUTE:
        return Way(name, step_model, optimizer)
    one_bucket = name in (TORCH_POWERSGD, GRACE_POWERSGD)
    ddp = DistributedDataParallel(step_model.model, process_group=group,
                                  bucket_cap_mb=ONE_BUCKET_MB if one_bucket else None)
    way = Way(name, replace(step_model, model=ddp), optimizer)
    if name == TORCH_FP16:
        ddp.register_comm_hook(group, fp16_compress_hook)
    elif name == GRACE_FP16:
        way.state = grace_legacy.ddp.register(ddp, FP16())
    elif name == TORCH_POWERSGD:
        way.state = PowerSGDState(process_group=group, matrix_approximation_rank=POWERSGD_RANK,
                                  start_powerSGD_iter=TORCH_POWERSGD_START, min_compression_rate=1,
                                  use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(way.state, powerSGD_hook)
    elif name == GRACE_POWERSGD:
        way.state = grace_legacy.ddp.register(ddp, PowerSGD(POWERSGD_RANK))
    elif name == TOPK:
        way.state = grace_legacy.ddp.register(ddp, Grace(TopK(DENSITY), memory=Residual()))
    return way


def build_ways(model: str, quick: bool, group: Any, rank: int) -> dict[str, Way]:
    """Every way (a collective: every rank, same order), PyTorch's PowerSGD past its allreduce steps."""
    ways = {name: build_way(name, model, quick, group, rank) for name in WAYS}
    for _ in range(TORCH_POWERSGD_START):
        ways[TORCH_POWERSGD].step()
    return ways


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    counter = CollectiveCounter().install()
    # One-rank groups (every rank makes all of them, in the same order) for the local cost.
    solo, _ = dist.new_subgroups(group_size=1)
    control = Path(args.control)

    def slowest(values: list[float], group: Any = None) -> list[float]:
        counter.counting = False
        try:
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            return tensor.tolist()
        finally:
            counter.counting = True

    def timed_step(way: Way, dense_bytes: int) -> dict[str, float]:
        dist.barrier()
        calls_before, payload_before, wire_before = counter.snapshot()
        elapsed, backward, seen = timed_on_link(way.step)
        calls, payload, wire = counter.snapshot()
        calls, payload, wire = calls - calls_before, payload - payload_before, wire - wire_before
        if way.name == ALLREDUCE:  # DDP's reducer calls Gloo from C++: one allreduce per bucket
            payload, wire = dense_bytes, ring_allreduce_bytes(dense_bytes, size)
        top = slowest([elapsed, backward, float(seen), wire, payload, calls])
        return {"step_s": top[0], "backward_s": top[1], "link_bytes": top[2], "wire_bytes": top[3],
                "payload_bytes": top[4], "collectives": top[5]}

    results: dict[str, Any] = {"workers": size, "density": DENSITY, "powersgd_rank": POWERSGD_RANK, "models": {}}
    request = 0
    for model in args.models:
        request_rate(control, request, args.rates[0], rank == 0, dist.barrier)
        request += 1
        ways = build_ways(model, args.quick, None, rank)
        bare = ways[COMPUTE].step_model.model
        numel = sum(p.numel() for p in bare.parameters())
        dense_bytes = 4 * numel
        dense_wire = ring_allreduce_bytes(dense_bytes, size)
        record: dict[str, Any] = {
            "parameters": numel, "tensors": len(list(bare.parameters())), "rates": {},
            "powersgd_documented": {f"min_compression_rate={rate}": dict(zip(
                ("dense_elements", "factor_elements"), powersgd_elements(bare, POWERSGD_RANK, rate), strict=True))
                for rate in (1, 2)}}
        # What each way's communication alone needs at 1 bit/s: dense, half of it in fp16, little otherwise.
        link_bits = {name: 8 * dense_wire * {ALLREDUCE: 1.0, TORCH_FP16: 0.5, GRACE_FP16: 0.5}.get(name, 0.0)
                     for name in WAYS}
        for phase, rate in enumerate(args.rates):
            if phase > 0:
                request_rate(control, request, rate, rank == 0, dist.barrier)
                request += 1
            plan = plan_steps({name: bits / rate for name, bits in link_bits.items()}, phase == 0,
                              args.warmup, args.steps, args.dense_steps, args.slow_steps)
            measured = interleave(plan, lambda name, ways=ways, dense=dense_bytes: timed_step(ways[name], dense))
            record["rates"][repr(rate)] = measured
            if rank == 0:
                print(f"{model} at {label(rate)}: " + ", ".join(
                    f"{n} {statistics.median(m['step_s']):.3f} s" for n, m in measured.items()), flush=True)
        # PyTorch's PowerSGD kept one bucket (its state is per bucket index): checked, not assumed.
        record["torch_powersgd_buckets"] = len(ways[TORCH_POWERSGD].state.p_memory_dict)
        del ways, bare
        gc.collect()

        # The local cost: the same ways on one-rank groups, every rank at once, interleaved.
        local = build_ways(model, args.quick, solo, rank)

        def local_step(name: str, local: dict[str, Way] = local) -> dict[str, float]:
            dist.barrier()
            start = time.perf_counter()
            local[name].step()
            return {"step_s": slowest([time.perf_counter() - start])[0]}

        record["local"] = interleave({name: (1, args.local_steps) for name in WAYS}, local_step)
        results["models"][model] = record
        del local
        gc.collect()
    if rank == 0:
        Path(args.json).write_text(json.dumps(results))
    end_worker()  # PyTorch's own DDP collectives can abort a finalizing interpreter


# -- the driver -------------------------------------------------------------------------------------------

def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.netns import TorchJob

    return limited_link.launch_workers("benchmarks.performance.ddp_hooks", args, TorchJob, WORKERS, {},
                                       ["--local-steps", str(args.local_steps)])


def main() -> None:
    parser = limited_link.parser(__doc__, "tiny models, two steps per way and rate: a smoke run",
                                 "a way", "a way")
    parser.add_argument("--local-steps", type=int, default=None, help="timed steps per way on one-rank groups")
    args = limited_link.parse(parser, full_steps=20)
    if args.local_steps is None:
        args.local_steps = 2 if args.quick else 10
    if args.worker:
        worker(args)
        return
    limited_link.drive("benchmarks.performance.ddp_hooks", args, launch, write,
                       lambda result: summary(result)["verdicts"])


if __name__ == "__main__":
    main()
