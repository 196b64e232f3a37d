"""L-GreCo's overhead on a small model: time of the error measurement, the dynamic program and the
broadcast per re-solve, against the time of a training step (what ``LGreCo.stats`` reports).

    horovodrun -np 2 -H localhost:2 python scripts/lgreco_overhead.py --model digits --base topk
    horovodrun -np 2 -H localhost:2 python scripts/lgreco_overhead.py --model cifar --base powersgd

Synthetic data, so only the timing means anything. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import horovod.torch as hvd
import torch
from torch import nn

import grace_legacy  # noqa: F401  (makes hvd.DistributedOptimizer accept grace_legacy compression)
from grace_legacy import Grace, LGreCo, PowerSGD, PowerSGDMemory, Residual, TopK


def digits_cnn() -> tuple[nn.Module, tuple[int, ...]]:
    """The example's CNN for 8x8 digits: 8 tensors, 72k parameters."""
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, (1, 8, 8)


def cifar_cnn() -> tuple[nn.Module, tuple[int, ...]]:
    """A VGG-like CNN for 32x32 images: 18 tensors, 0.6M parameters."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    model = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), *block(128, 256), nn.Flatten(),
                          nn.Linear(256 * 2 * 2, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, (3, 32, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["digits", "cifar"], default="digits")
    parser.add_argument("--base", choices=["topk", "powersgd"], default="topk")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--resolution", type=int, default=1000)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, shape = digits_cnn() if args.model == "digits" else cifar_cnn()
    if args.base == "topk":
        schedule = LGreCo(TopK(), [1.0, 0.1, 0.05, 0.01, 0.005], reference=0.01, interval=args.interval,
                          resolution=args.resolution)
        memory = Residual()
    else:
        schedule = LGreCo(PowerSGD(), [8, 4, 2, 1], reference=2, interval=args.interval, resolution=args.resolution)
        memory = PowerSGDMemory()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=Grace(schedule, memory))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(hvd.rank())
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, *shape, generator=data)
        y = torch.randint(0, 10, (args.batch_size,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if hvd.rank() == 0:
        stats = schedule.stats
        print(json.dumps({"model": args.model, "base": args.base, "tensors": len(stats["lgreco"]["choices"]),
                          "parameters": sum(p.numel() for p in model.parameters()), "ranks": hvd.size(),
                          "interval": args.interval, "resolution": args.resolution, "volume": stats["volume"],
                          "overhead": stats["lgreco"]["overhead"]}))


if __name__ == "__main__":
    main()
