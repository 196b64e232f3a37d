"""A fault at every point of a step, on Horovod's optimizer, for every route and compressor family.

For each configuration: train one step and commit (``hvd.elastic.TorchState.save``), then learn
how many collective launches, waits, ``compress``/``decompress`` calls and memory updates the
next step reaches. Then, for every one of those points, every rank fails there with Horovod's
own ``HorovodInternalError`` (tests/faults.py), and the worker checks what an elastic job relies
on: the error that reaches the training loop is exactly ``HorovodInternalError``;
``TorchState.restore()`` succeeds and puts the compression state back to the commit bit for bit;
the steps trained again from there end bit-identical to a run that never failed, on every rank.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import traceback

import horovod.torch as hvd
import torch
import torch.distributed as dist
from horovod.torch.elastic import TorchState
from horovod.torch.mpi_ops import HorovodInternalError
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from grace_legacy import (
    DGC,
    EF21,
    FP16,
    QSGD,
    Accordion,
    Broadcast,
    DGCMemory,
    Grace,
    Legacy,
    PowerSGD,
    RandomK,
    Residual,
    ScatterGather,
    Signum,
    Threshold,
    TopK,
)
from grace_legacy.schedules.base import Schedule
from tests.distributed.checks import Recorder, gather_from_ranks, parse_args
from tests.distributed.harness import Net, batch, loss_of
from tests.faults import KINDS, FaultInjector
from tests.torch_gather import torch_gather_from_ranks

#: Small buckets, so that a step launches several exchanges (ours, and DDP's in MB).
BUCKET = 1024
BUCKET_MB = 0.002

CONFIGS = {
    "allgather topk+residual": lambda: Grace(TopK(0.1), bucket_bytes=BUCKET),
    "allgather topk per tensor": lambda: Grace(TopK(0.2), bucket_bytes=0),
    "allreduce fp16": lambda: Grace(FP16(), bucket_bytes=BUCKET),
    "allreduce randomk+ef21": lambda: Grace(RandomK(0.25, seed=3), memory=EF21(), bucket_bytes=BUCKET),
    "rounds powersgd": lambda: Grace(PowerSGD(2), bucket_bytes=BUCKET),
    "dense and fallback legacy": lambda: Grace(Legacy(TopK(), by="layer", values=[1.0, 0.6, 0.1], splits=[10, 200]),
                                               bucket_bytes=BUCKET),
    "two-phase topk+residual": lambda: Grace(TopK(0.1), memory=Residual(), communicator=ScatterGather(),
                                             bucket_bytes=BUCKET),
    "quantizer qsgd+residual": lambda: Grace(QSGD(16, seed=1), memory=Residual(), bucket_bytes=BUCKET),
    "signs signum": lambda: Grace(Signum(0.9), bucket_bytes=BUCKET),
    "headers threshold": lambda: Grace(Threshold(0.01), bucket_bytes=BUCKET),
    "momentum dgc": lambda: Grace(DGC(0.1, seed=2), memory=DGCMemory(0.9), bucket_bytes=BUCKET),
    "broadcast topk": lambda: Grace(TopK(0.1), communicator=Broadcast()),
    "adaptive accordion": lambda: Grace(Accordion(TopK(), 0.5, 0.1, interval=2), bucket_bytes=BUCKET),
}

#: On the DDP hook a failed step's collectives stay in the process group's one ordered stream, so a
#: fault must strike every rank at the same place in that stream. The n-th launch or wait is; the
#: n-th compress or memory update is not where the owners of a two-phase exchange re-encode their
#: own (different) segments. Those configurations are swept at their launches and waits there.
ALIGNED_ONLY = {"two-phase topk+residual": ("launch", "wait")}
#: Configurations whose segments are cut by bucket (see ``sweep_ddp``).
BY_BUCKET = {"two-phase topk+residual"}
#: Configurations the DDP hook sends a bucket at a time, as one tensor (``Grace.start_whole``:
#: an elementwise compressor and no memory), so their steps have no memory update to fault.
WHOLE_ON_DDP = {"allreduce fp16"}


def digest(model: torch.nn.Module) -> str:
    h = hashlib.blake2b(digest_size=12)
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def same(a, b) -> bool:
    """Equal bit for bit: tensors by dtype, shape and bytes; containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def without_placement(state: dict) -> dict:
    """A bundle's state without where it ran: a restore leaves that to the next step."""
    return {key: value for key, value in state.items() if key != "placement"}


def compression_parts(bundle: Grace) -> tuple[list, list]:
    compressor = bundle.compressor
    compressors = [compressor.base] if isinstance(compressor, Schedule) else [compressor]
    return compressors, [bundle.memory]


def sweep_horovod(rec: Recorder, label: str) -> dict[str, int]:
    torch.manual_seed(0)
    model = Net()
    # No momentum: Horovod's TorchState.restore() hands torch's load_state_dict its saved momentum
    # buffers, which torch keeps without copying, so the next step writes into the saved copy and
    # a second restore from the same commit brings back the written-over buffers (Horovod's
    # optimizer handler, whatever the compression; docs/HOROVOD_COMPATIBILITY.md).
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    bundle = CONFIGS[label]()
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=bundle)
    injector = FaultInjector(opt._grace_backend, HorovodInternalError)
    opt._grace_backend = injector
    state = TorchState(model, opt, compression=bundle)
    compressors, memories = compression_parts(bundle)

    def step(k: int) -> None:
        opt.zero_grad()
        loss_of(model, batch(k, hvd.rank())).backward()
        opt.step()

    step(0)
    state.save()
    committed = without_placement(bundle.state_dict())
    committed_model, committed_optimizer = digest(model), copy.deepcopy(opt.state_dict())
    injector.count_from_now()
    with injector.watching(compressors, memories):
        step(1)
    counts = {kind: injector.counts[kind] for kind in KINDS}
    step(2)
    reference = digest(model)
    state.restore()
    rec.check(f"{label}: a restore without a fault gives the commit back",
              same(without_placement(bundle.state_dict()), committed))

    for kind in KINDS:
        for n in range(counts[kind]):
            point = f"{label}: {kind} #{n}"
            injector.arm(kind, n)
            raised = None
            try:
                with injector.watching(compressors, memories):
                    step(1)
            except BaseException as error:  # noqa: BLE001 (what reaches the loop is the point)
                raised = error
            rec.check(f"{point}: the loop gets HorovodInternalError", type(raised) is HorovodInternalError,
                      "nothing raised" if raised is None else
                      "".join(traceback.format_exception(raised))[-1500:])
            injector.recover()
            try:
                state.restore()
            except BaseException:  # noqa: BLE001
                rec.check(f"{point}: restore", False, traceback.format_exc()[-1500:])
                continue
            rec.check(f"{point}: the compression state is the commit's",
                      same(without_placement(bundle.state_dict()), committed))
            rec.check(f"{point}: the model and optimizer are the commit's",
                      digest(model) == committed_model and same(opt.state_dict(), committed_optimizer))
            step(1)
            step(2)
            rec.check(f"{point}: trained on as if it never failed", digest(model) == reference)
            state.restore()
    digests = gather_from_ranks(torch.tensor(list(bytes.fromhex(reference)), dtype=torch.uint8))
    rec.check(f"{label}: ranks identical", all(torch.equal(d, digests[0]) for d in digests))
    check_compressed(rec, label, bundle)
    return counts


def check_compressed(rec: Recorder, label: str, bundle: Grace) -> None:
    routes = bundle.stats["tensors_by_route"]
    rec.check(f"{label}: compression on", set(routes) - {"dense", "dense-fallback"}, str(routes))


def sweep_ddp(rec: Recorder, label: str) -> dict[str, int]:
    """The same sweep on the DDP hook, where recovering means what a restarted worker does:
    a new model, optimizer, DDP wrapper and compression, loaded from the last checkpoint."""
    rank = dist.get_rank()

    def build(checkpoint: dict | None):
        torch.manual_seed(0)
        model = Net()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
            sgd.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        state = grace_legacy.ddp.register(ddp, CONFIGS[label]())
        if checkpoint is not None:
            state.load_state_dict(copy.deepcopy(checkpoint["compression"]))
        injector = FaultInjector(state.backend, dist.DistBackendError)
        state.backend = injector
        return model, ddp, sgd, state, injector

    def step(parts, k: int) -> None:
        model, ddp, sgd, _, _ = parts
        sgd.zero_grad()
        loss_of(ddp, batch(k, rank)).backward()
        sgd.step()

    parts = build(None)
    step(parts, 0)
    checkpoint = {"model": copy.deepcopy(parts[0].state_dict()), "optimizer": copy.deepcopy(parts[2].state_dict()),
                  "compression": parts[3].state_dict()}
    committed = without_placement(checkpoint["compression"])
    injector = parts[4]
    compressors, memories = compression_parts(parts[3].grace)
    injector.count_from_now()
    with injector.watching(compressors, memories):
        step(parts, 1)
    counts = {kind: injector.counts[kind] for kind in KINDS}
    step(parts, 2)
    reference = digest(parts[0])
    # A restarted worker's DDP wrapper steps once with DDP's first bucket layout, then rebuilds its
    # buckets in the order the gradients came (the uninterrupted run rebuilt them after step 0), so
    # a route that cuts segments by bucket compresses step 1 differently after any restart. The
    # recovery is then held to a restart from the same checkpoint without a fault.
    del parts
    gc.collect()
    parts = build(checkpoint)
    step(parts, 1)
    step(parts, 2)
    resumed = digest(parts[0])
    if label in BY_BUCKET:
        reference = resumed
    else:
        rec.check(f"{label}: a restart from the checkpoint trains on as if nothing happened", resumed == reference)

    def rewind(parts) -> None:
        """Back to the checkpoint in place (the wrapper survives a step that did not fail)."""
        parts[0].load_state_dict(checkpoint["model"])
        parts[2].load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
        parts[3].load_state_dict(copy.deepcopy(checkpoint["compression"]))

    rewind(parts)
    for kind in ALIGNED_ONLY.get(label, KINDS):
        for n in range(counts[kind]):
            point = f"{label}: {kind} #{n}"
            rec.check(f"{point}: the loaded state is the checkpoint's",
                      same(without_placement(parts[3].state_dict()), committed))
            injector = parts[4]
            compressors, memories = compression_parts(parts[3].grace)
            injector.arm(kind, n)
            raised = None
            try:
                with injector.watching(compressors, memories):
                    step(parts, 1)
            except BaseException as error:  # noqa: BLE001 (what reaches the loop is the point)
                raised = error
            rec.check(f"{point}: the loop gets torch.distributed's DistBackendError",
                      type(raised) is dist.DistBackendError,
                      "nothing raised" if raised is None else "".join(traceback.format_exception(raised))[-1500:])
            injector.recover()
            del parts
            gc.collect()
            parts = build(checkpoint)
            step(parts, 1)
            step(parts, 2)
            rec.check(f"{point}: trained on from the checkpoint as if it never failed", digest(parts[0]) == reference)
            rewind(parts)
    digests = torch_gather_from_ranks(torch.tensor(list(bytes.fromhex(reference)), dtype=torch.uint8))
    rec.check(f"{label}: ranks identical", all(torch.equal(d, digests[0]) for d in digests))
    check_compressed(rec, label, parts[3].grace)
    swept = ALIGNED_ONLY.get(label, KINDS)
    return {kind: counts[kind] if kind in swept else 0 for kind in KINDS}


def main() -> None:
    args = parse_args([(("--configs",), {"default": ",".join(CONFIGS)}),
                       (("--engine",), {"choices": ["horovod", "ddp"], "default": "horovod"})])
    if args.engine == "horovod":
        hvd.init()
        rec, sweep = Recorder(args.out), sweep_horovod
    else:
        dist.init_process_group("gloo")
        rec, sweep = Recorder(args.out, dist.get_rank()), sweep_ddp
    # Each fault point rebuilds the model and collects the old one; with torch imported a full
    # collection walks some hundred thousand objects that live for the whole run: set those aside once.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # what the first optimizer imports (torch._dynamo)
    gc.freeze()
    points = {}
    for label in args.configs.split(","):
        points[label] = rec.guard(f"{label}: sweep", sweep, rec, label)
    rec.extra["points"] = points
    rec.write()
    if args.engine == "ddp":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
