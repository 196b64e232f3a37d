"""ScatterGather under a real launcher, against the independent two-phase reference
(tests/two_phase.py).

``--engine horovod`` (horovodrun, Gloo or MPI) or ``--engine torch`` (torchrun, Gloo): every case of
the reference runs through the engine's real backend (its all-to-all and allgather), fused and per
tensor (two of them also with ``ScatterGather(owner_feedback=False)``), and every rank's result must
equal the reference bit for bit (every rank computes it: it knows every rank's gradients). Then the
routes of a trained model: through Horovod's optimizer or the DDP hook, with ``communicator="auto"``
it takes the scatter-gather for Top-k at 3 ranks or more, by default the gather at any number; it
ends with the same parameters on every rank.
"""

from __future__ import annotations

import hashlib

import horovod.torch as hvd
import torch
import torch.distributed as dist

import grace_legacy.ddp
from grace_legacy import Grace, ScatterGather, TopK
from grace_legacy.backends.horovod import HorovodBackend
from grace_legacy.backends.torch_distributed import TorchDistributedBackend
from grace_legacy.runtime import paths
from tests.distributed.checks import Recorder, parse_args
from tests.distributed.harness import Net, batch, loss_of
from tests.helpers import bits
from tests.torch_gather import torch_gather_from_ranks
from tests.two_phase import SETUPS, SIZES, STEPS, gradients, reference

# What each rank compares against the reference.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: The set-ups also run in bfloat16 (every one does in-process, tests/unit/test_scatter_gather.py).
IN_BFLOAT16 = ("topk+residual", "signsgd", "qsgd", "bf16", "sketch+residual")


def through_backend(rec: Recorder, backend, label: str, fused: bool, dtype: torch.dtype,
                    owner_feedback: bool = True) -> None:
    make, memory = SETUPS[label]
    bundle = Grace(make(), memory=memory(), communicator=ScatterGather(owner_feedback=owner_feedback),
                   dense_fallback=False, bucket_bytes=1 << 20 if fused else 0)
    bundle.plan_buckets([(name, 4) for name in SIZES])
    world, rank = backend.size(), backend.rank()
    expected = reference(label, world, dtype, owner_feedback=owner_feedback) if fused else None
    label = label if owner_feedback else f"{label} without the owners' feedback"
    for step in range(STEPS):
        mine = gradients(world, step, dtype)[rank]
        pending = {name: bundle.start(g, name, backend, average=True) for name, g in zip(SIZES, mine, strict=True)}
        got = [pending[name]() for name in SIZES]
        bundle.end_step()
        if expected is not None:
            same = all(torch.equal(bits(g), bits(e)) for g, e in zip(got, expected[step], strict=True))
            rec.check(f"{label} {dtype} fused: step {step} equals the reference", same)
    routes = bundle.stats["tensors_by_route"]
    rec.check(f"{label} {dtype} fused={fused}: every tensor scatter-gathered", set(routes) == {"scattergather"},
              str(routes))


def digest(model: torch.nn.Module) -> torch.Tensor:
    h = hashlib.blake2b(digest_size=16)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return torch.tensor(list(h.digest()), dtype=torch.uint8)


def auto_route(rec: Recorder, engine: str, communicator: str | None) -> None:
    """Top-k 0.05 with ``communicator="auto"``: the scatter-gather from 3 ranks (the gather at 2);
    with no communicator named, the gather at any number of ranks."""
    torch.manual_seed(0)
    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    compression = Grace(TopK(0.05), dense_fallback=False, communicator=communicator)
    if engine == "horovod":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
        trained, rank, world = model, hvd.rank(), hvd.size()
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
        grace_legacy.ddp.register(trained, compression)
        opt, rank, world = sgd, dist.get_rank(), dist.get_world_size()
    for step in range(3):
        opt.zero_grad()
        loss_of(trained, batch(step, rank)).backward()
        opt.step()
    routes = compression.stats["tensors_by_route"]
    # Each tensor's route by the link-byte model, written out: (P - 1) * packed for the gather;
    # for the scatter-gather its busiest link's, both phases' payloads of every segment but the
    # one that link's rank owns (the owner of a smallest segment); the scatter-gather only from 3
    # ranks.
    expected: dict[str, int] = {}
    for p in model.parameters():
        k = lambda n: max(1, int(0.05 * n))  # noqa: E731
        gather = (world - 1) * 8 * k(p.numel())
        base, extra = divmod(p.numel(), world)
        segments = [base + 1] * extra + [base] * (world - extra)
        payloads = [2 * 8 * k(s) if s else 0 for s in segments]
        scatter = sum(payloads) - min(payloads)
        route = "scattergather" if scatter < gather and world > 2 and communicator == "auto" else "allgather"
        expected[route] = expected.get(route, 0) + 3
    label = communicator or "default"
    rec.check(f"{label}: routes at {world} ranks are the link-byte model's", routes == expected,
              f"{routes} != {expected}")
    if world > 2 and communicator == "auto":
        rec.check("auto: the largest tensors take the scatter-gather", routes.get("scattergather", 0) > 0,
                  str(routes))
    mine = digest(model)
    if engine == "horovod":
        every = hvd.allgather(mine.reshape(1, -1), name="digests")
    else:
        every = torch_gather_from_ranks(mine)
    rec.check(f"{label}: parameters identical on every rank", all(torch.equal(row, every[0]) for row in every))


def main() -> None:
    args = parse_args([(("--engine",), {"choices": ["horovod", "torch"], "required": True})])
    if args.engine == "horovod":
        hvd.init()
        backend, rec = HorovodBackend(), Recorder(args.out)
    else:
        dist.init_process_group("gloo")
        backend, rec = TorchDistributedBackend(), Recorder(args.out, dist.get_rank())
    rec.extra["device_path"] = paths.FORCE_DEVICE_PATH  # GRACE_LEGACY_DEVICE_PATH, as this process read it
    for label in SETUPS:
        for dtype in DTYPES.values() if label in IN_BFLOAT16 else [torch.float32]:
            rec.guard(f"{label} {dtype}: fused", through_backend, rec, backend, label, True, dtype)
        rec.guard(f"{label}: per tensor", through_backend, rec, backend, label, False, torch.float32)
    for label in ("efsignsgd", "topk+residual"):
        rec.guard(f"{label}: fused, without the owners' feedback", through_backend, rec, backend, label, True,
                  torch.float32, False)
    for communicator in ("auto", None):
        rec.guard(f"{communicator or 'default'} route", auto_route, rec, args.engine, communicator)
    rec.write()
    if args.engine == "torch":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
