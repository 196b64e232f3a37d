"""Real ranks' runs of every case of :mod:`tests.simulate_cases`, for the simulator to be compared
with (``test_simulate.py``): under ``horovodrun`` through ``hvd.DistributedOptimizer`` (the user's
path), under ``torchrun`` through :func:`grace_legacy.simulate.synchronize` with the
``torch.distributed`` backend (the optimizer's step on any backend). Each launcher runs its share
of the cases, half of it on all the ranks, the other half on each half of them (two worlds, as
process sets or groups, side by side).
Each rank saves its runs to ``<out>/rank<r>.pt``."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from grace_legacy.grace import as_bundle
from tests.distributed.harness import Net, batch, loss_of
from tests.simulate_cases import LAUNCHERS, LR, STEPS, record, setups


def horovod_runs(out: Path, launcher: str) -> None:
    import horovod.torch as hvd

    import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer takes grace_legacy compression)

    hvd.init(process_sets="dynamic")
    half = hvd.size() // 2
    halves = [hvd.add_process_set(list(range(half))), hvd.add_process_set(list(range(half, hvd.size())))]
    runs = {}
    for index, (world, process_set) in enumerate(((hvd.size(), hvd.global_process_set),
                                                  (half, halves[hvd.rank() // half]))):
        for label, make in setups(launcher, index):
            torch.manual_seed(0)
            model = Net()
            compression = make()
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                                 named_parameters=model.named_parameters(),
                                                 compression=compression, process_set=process_set)
            grads = []
            for step in range(STEPS):
                optimizer.zero_grad()
                loss_of(model, batch(step, process_set.rank())).backward()
                optimizer.step()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            runs[(world, label)] = record(model, optimizer.grace.stats, grads)
    for process_set in halves:
        hvd.remove_process_set(process_set)
    torch.save(runs, out / f"rank{hvd.rank()}.pt")


def torch_runs(out: Path, launcher: str) -> None:
    import torch.distributed as dist

    from grace_legacy.backends.torch_distributed import TorchDistributedBackend
    from grace_legacy.simulate import plan_buckets, synchronize

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    half = size // 2
    halves = [dist.new_group(list(range(half))), dist.new_group(list(range(half, size)))]
    runs = {}
    for index, (world, group) in enumerate(((size, None), (half, halves[rank // half]))):
        backend = TorchDistributedBackend(group)
        for label, make in setups(launcher, index):
            torch.manual_seed(0)
            model = Net()
            bundle = as_bundle(make(), "simulate_worker")
            plan_buckets(bundle, model.named_parameters())
            sgd = torch.optim.SGD(model.parameters(), lr=LR)
            grads = []
            for step in range(STEPS):
                sgd.zero_grad()
                loss_of(model, batch(step, backend.rank())).backward()
                synced = synchronize(bundle, {n: p.grad for n, p in model.named_parameters()}, backend)
                for name, p in model.named_parameters():
                    p.grad = synced[name]
                sgd.step()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            runs[(world, label)] = record(model, bundle.stats, grads)
    torch.save(runs, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launcher", choices=LAUNCHERS, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    (torch_runs if args.launcher == "torch" else horovod_runs)(args.out, args.launcher)


if __name__ == "__main__":
    main()
