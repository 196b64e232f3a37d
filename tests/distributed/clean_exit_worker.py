"""A short job as a new user writes it, which must exit cleanly (``test_clean_exit.py``).

``--launcher torchrun``: 20 DDP steps on Gloo with a small MLP and
``grace_legacy.ddp.register(ddp_model, Legacy(TopK(), ...))``, then ``dist.destroy_process_group()``
(issue #37's report). ``--launcher horovodrun``: the same under ``hvd.DistributedOptimizer`` with
the same compression. Nothing is waited for or cleaned up beyond what such a script does: the
process ends right after the last step. ``--out`` is accepted and unused (the launcher passes it).
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from grace_legacy import Legacy, TopK

STEPS = 20


def model_and_data(rank: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(16, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
               for _ in range(STEPS)]
    return model, batches


def compression() -> Legacy:
    return Legacy(TopK(), by="layer", values=[1.0, 0.01], splits=[1000])


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def with_torchrun() -> None:
    dist.init_process_group("gloo")
    model, batches = model_and_data(dist.get_rank())
    ddp_model = DistributedDataParallel(model)
    grace_legacy.ddp.register(ddp_model, compression())
    train(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.1), batches)
    print(f"rank {dist.get_rank()} trained {STEPS} steps", flush=True)
    dist.destroy_process_group()


def with_horovodrun() -> None:
    import horovod.torch as hvd  # here: the torchrun job runs where Horovod is not installed too

    hvd.init()
    model, batches = model_and_data(hvd.rank())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), compression=compression())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train(model, optimizer, batches)
    print(f"rank {hvd.rank()} trained {STEPS} steps", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--launcher", choices=["torchrun", "horovodrun"], required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    with_torchrun() if args.launcher == "torchrun" else with_horovodrun()
