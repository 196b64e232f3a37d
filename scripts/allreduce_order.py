"""In which order a real launcher's CPU allreduce adds the ranks' tensors, and how it averages: the
facts ``grace_legacy/simulate/sums.py`` reproduces.

    horovodrun -np 4 -H localhost:4 --gloo python scripts/allreduce_order.py horovod
    horovodrun -np 4 -H localhost:4 --mpi python scripts/allreduce_order.py horovod
    torchrun --nproc-per-node 4 scripts/allreduce_order.py torch

Every rank allreduces float32 tensors of 7 to 3,000,000 elements whose entries span many orders of
magnitude (so that each order of addition gives other bits); rank 0 knows every rank's tensor,
computes each reduction of ``REDUCTIONS`` and prints, per size, those whose sum, and whose average,
are the allreduce's bit for bit.
"""

from __future__ import annotations

import sys

import torch

from grace_legacy.simulate.sums import REDUCTIONS

SIZES = (7, 1000, 300_000, 3_000_000)


def contribution(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 31 * rank + numel)
    return (torch.randn(numel, generator=g, dtype=torch.float64)
            * torch.exp(6 * torch.randn(numel, generator=g, dtype=torch.float64))).float()


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1:] == ["horovod"]:
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def allreduce(t: torch.Tensor, average: bool, name: str) -> torch.Tensor:
            return hvd.allreduce(t, name=name, op=hvd.Average if average else hvd.Sum)
    elif sys.argv[1:] == ["torch"]:
        import torch.distributed as dist

        from grace_legacy.backends.torch_distributed import TorchDistributedBackend

        dist.init_process_group("gloo")
        backend = TorchDistributedBackend()
        rank, size = backend.rank(), backend.size()

        def allreduce(t: torch.Tensor, average: bool, name: str) -> torch.Tensor:
            return backend.wait(backend.allreduce_async(t, name, average))
    else:
        raise SystemExit("usage: scripts/allreduce_order.py horovod|torch (under horovodrun or torchrun)")
    for numel in SIZES:
        tensors = [contribution(r, numel) for r in range(size)]
        found = {}
        for average in (False, True):
            got = allreduce(tensors[rank], average, f"order.{numel}.{average}")
            found[average] = [name for name, reduce in REDUCTIONS.items()
                              if torch.equal(reduce(tensors, average).view(torch.int32), got.view(torch.int32))]
        if rank == 0:
            print(f"{size} ranks, {numel:>9,} float32: sum as {found[False] or 'none'}; "
                  f"average as {found[True] or 'none'}", flush=True)


if __name__ == "__main__":
    main()
