"""Trains ``model()`` with a LEGACY schedule given in the reference flags for two epochs, with the
default communicator and with ``communicator="auto"``, and reports the volume ``stats`` each
measured; the test compares them with what the planner predicted for the same model, flags and
number of workers."""

from __future__ import annotations

import horovod.torch as hvd
import torch
from torch import nn

from grace_legacy import Grace, Legacy, Residual, TopK
from tests.distributed.checks import Recorder, parse_args

STEPS_PER_EPOCH = 3


def model() -> nn.Module:
    """Tensors in every size group of the test's splits, some large enough that the dense
    fallback never applies and some small enough that it does."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 64), nn.ReLU(),
                         nn.Linear(64, 10), nn.LayerNorm(10))


def main() -> None:
    args = parse_args([(("--by",), {}), (("--group-compressions",), {}), (("--group-splits",), {}),
                       (("--epochs",), {"type": int})])
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    for communicator in ("default", "auto"):
        rec.extra[communicator] = train(rec, args, communicator)
    rec.write()


def train(rec: Recorder, args, communicator: str) -> dict:
    torch.manual_seed(0)
    net = model()
    schedule = Legacy.from_flags(TopK(), args.by, group_compressions=args.group_compressions,
                                   group_splits=args.group_splits, epochs=args.epochs)
    compression = Grace(schedule, memory=Residual(), communicator="auto" if communicator == "auto" else None)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                   named_parameters=net.named_parameters(), compression=compression)
    generator = torch.Generator().manual_seed(hvd.rank())
    for epoch in range(args.epochs):
        compression.set_epoch(epoch)
        for _ in range(STEPS_PER_EPOCH):
            opt.zero_grad()
            x = torch.randn(4, 3, 8, 8, generator=generator)
            nn.functional.cross_entropy(net(x), torch.randint(0, 10, (4,), generator=generator)).backward()
            opt.step()
    stats = compression.stats
    rec.check(f"{communicator}: every step sent something", stats["bytes_sent"] > 0, str(stats))
    return {key: stats[key] for key in ("volume", "wire_bytes", "wire_dense")} | {"routes": stats["tensors_by_route"]}


if __name__ == "__main__":
    main()
