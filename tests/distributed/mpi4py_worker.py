"""Horovod initialised from an mpi4py communicator (``hvd.init(comm=...)``), the whole world or one
half of it from ``Split``, with grace_legacy compression: every synchronized gradient equals the
mean over the communicator's members of each member's own Top-k, computed independently of
Horovod (the local gradients exchanged with mpi4py, Top-k by a full sort)."""

from __future__ import annotations

import json

import horovod.torch as hvd
import torch
from mpi4py import MPI

from grace_legacy import Grace, NoMemory, TopK
from tests.distributed.checks import Recorder, parse_args, topk_contribution
from tests.distributed.harness import Net, loss_of

RATIO = 0.3


def train_on(comm, label: str, rec: Recorder) -> float:
    """Three checked steps with Horovod initialised on ``comm``; this rank's parameter checksum."""
    hvd.init(comm=comm)
    rec.check(f"{label}: hvd.size() is the communicator's", hvd.size() == comm.size, f"{hvd.size()} != {comm.size}")
    rec.check(f"{label}: hvd.rank() is the communicator's", hvd.rank() == comm.rank, f"{hvd.rank()} != {comm.rank}")
    torch.manual_seed(0)
    model = Net()
    compression = Grace(TopK(RATIO), memory=NoMemory())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    for step in range(3):
        # Data by *world* rank, so that the two halves average different gradients.
        data_rank = MPI.COMM_WORLD.rank
        opt.zero_grad()
        local = local_gradients_of(model, step, data_rank)
        loss_of(model, batch_of(step, data_rank)).backward()
        opt.synchronize()
        members = comm.allgather({name: g.numpy() for name, g in local.items()})
        for name, p in model.named_parameters():
            contributions = [topk_contribution(torch.from_numpy(m[name]), RATIO, comm.size) for m in members]
            expected = sum(contributions[1:], contributions[0]) / len(contributions)
            rec.close(p.grad, expected, f"{label}: step {step} {name}: mean over the communicator's members")
        with opt.skip_synchronize():
            opt.step()
    hvd.shutdown()
    return sum(p.detach().double().sum().item() for p in model.parameters())


def main() -> None:
    args = parse_args()
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    everyone = world.allgather(train_on(world, "world", rec))
    rec.check("world: all ranks agree on the parameters", len(set(everyone)) == 1, str(everyone))
    # Two halves, [0, 1] and [2, 3]: each its own Horovod job on its own communicator.
    half = world.Split(color=world.rank // 2, key=world.rank)
    everyone = world.allgather(train_on(half, "halves", rec))
    rec.check("halves: members agree on the parameters", everyone[0] == everyone[1] and everyone[2] == everyone[3],
              str(everyone))
    rec.check("halves: the two halves trained apart", everyone[0] != everyone[2], str(everyone))
    args.out.mkdir(parents=True, exist_ok=True)
    # Named by world rank: each half has its own ranks 0 and 1.
    (args.out / f"rank{world.rank}.json").write_text(json.dumps({"checks": rec.checks}))


def batch_of(step: int, data_rank: int):
    g = torch.Generator().manual_seed(1000 * step + 17 * data_rank)
    return torch.randn(8, 2, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


def local_gradients_of(model, step: int, data_rank: int) -> dict[str, torch.Tensor]:
    twin_grads = torch.autograd.grad(loss_of(model, batch_of(step, data_rank)), list(model.parameters()))
    return {name: g.detach().clone() for (name, _), g in zip(model.named_parameters(), twin_grads, strict=True)}


if __name__ == "__main__":
    main()
