"""The device check's DDP worker: every zoo case through the grace_legacy DDP hook, under real
``torchrun``, on any device and process-group backend, without Horovod.

Every rank runs this. The model's parameters have the shapes of :data:`tests.zoo_in_process.TENSORS`
and its loss is ``sum_p (p * x_p).sum()``, so each parameter's local gradient is exactly the input
``x_p`` fed to it: the made-up gradient :func:`tests.zoo_in_process.gradient` of this rank and step.
The hook's synchronized gradient (``p.grad`` after the backward pass) must then equal the case's
rule over every rank's twin contribution (:func:`tests.zoo_in_process.twin_step_sent`, gathered
through the library's backend: a plain ``all_gather`` as the last collective can abort the worker
at exit, docs/GUARANTEES.md#clean-exit), within the case's tolerances (or, where the process group
sums in 16 bits, within that sum's rounding: :func:`tests.reference.expected_and_bound`), and be
bit-identical on every rank; the bytes the hook counts must be the twin's. Each rank writes
``rank<r>.json`` with its failed checks to ``--out``.

    torchrun --nproc-per-node 2 -m benchmarks.device_check.ddp_worker --out DIR --device cuda --backend gloo
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from tests.reference import expected_and_bound, mean_rule, mismatch, twin_contributions
from tests.registry import zoo_cases
from tests.torch_gather import torch_gather_from_ranks
from tests.zoo_in_process import TENSORS, gradient, twin_step_sent

#: DDP's bucket cap in MB: small, so that the parameters span several buckets.
BUCKET_MB = 0.05


def parameter_name(name: str) -> str:
    return name.replace(".", "_")


class GradientModel(nn.Module):
    """Parameters of the zoo's shapes; ``forward(inputs)`` is ``sum_p (p * inputs[p]).sum()``, whose
    gradient with respect to ``p`` is ``inputs[p]``."""

    def __init__(self, names: list[str], device: torch.device) -> None:
        super().__init__()
        for name in names:
            shape, _ = TENSORS[name]
            self.register_parameter(parameter_name(name), nn.Parameter(torch.zeros(shape, device=device)))

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p * inputs[name]).sum() for name, p in self.named_parameters())


def run_case(case, names: list[str], device: torch.device, steps: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    compression, twin, twin_memory = case.build()
    twin.set_rank(rank)
    model = GradientModel(names, device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    state = grace_legacy.ddp.register(ddp, compression)
    communicator = getattr(compression, "communicator", None)
    expected_bytes = 0
    for step in range(steps):
        inputs = {parameter_name(name): gradient(name, rank, step, device) for name in names}
        for p in model.parameters():
            p.grad = None
        ddp(inputs).backward()
        twins = twin_contributions(lambda grad, key: twin_step_sent(
            twin, twin_memory, grad, key, communicator, getattr(compression, "dense_fallback", True), world),
            inputs, compression.compressor.traits.spans_step)
        for name in names:
            key = parameter_name(name)
            contribution, sent, route, dtypes = twins[key]
            expected_bytes += sent
            contributions = torch_gather_from_ranks(contribution)
            combined = mean_rule(contributions) if route.startswith("dense") else case.rule(contributions)
            expected, bound = expected_and_bound(combined, twin_memory, key, route, [inputs[key].dtype, *dtypes],
                                                 contributions, step)
            got = getattr(model, key).grad
            where = f"{case.label}: rank {rank} step {step} {name}"
            if got is None or got.device != device or got.shape != expected.shape:
                failures.append(f"{where}: got {None if got is None else (tuple(got.shape), got.device)}")
                continue
            why = mismatch(got, expected, bound, case.rtol, case.atol)
            if why is not None:
                failures.append(f"{where}: {why}")
            if not all(torch.equal(g, got) for g in torch_gather_from_ranks(got)):
                failures.append(f"{where}: not bit-identical on every rank")
        twin.end_step()
    if state.stats["bytes_sent"] != expected_bytes:
        failures.append(f"{case.label}: rank {rank}: bytes_sent {state.stats['bytes_sent']} != the twin's "
                        f"{expected_bytes}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="leave out the largest tensor (a quicker run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        # Every rank on the one GPU under Gloo; under NCCL one rank per GPU.
        index = int(os.environ.get("LOCAL_RANK", 0)) if args.backend == "nccl" else 0
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=180))
    names = [name for name in TENSORS if not (args.small and name == "huge.weight")]
    report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "device": str(device),
              "backend": args.backend, "cases": [], "failures": [], "seconds": {}}
    try:
        for case in zoo_cases():
            started = time.perf_counter()
            try:
                report["failures"] += run_case(case, names, device, args.steps)
            except Exception:
                report["failures"].append(f"{case.label}: rank {dist.get_rank()}: {traceback.format_exc()[-1500:]}")
            report["cases"].append(case.label)
            report["seconds"][case.label] = round(time.perf_counter() - started, 2)
    finally:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
