"""The plain torchrun path the framework workers are compared with: ``DistributedDataParallel`` and
``grace_legacy.ddp.register`` by hand, Gloo, the shared model, data and compression."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from tests.distributed.frameworks_common import EPOCHS, Tiny, batches, compression, loss_of, optimizer, write_report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Tiny()
    ddp_model = DistributedDataParallel(model)
    bundle = compression()
    state = grace_legacy.ddp.register(ddp_model, bundle)
    opt = optimizer(ddp_model.parameters())
    for epoch in range(EPOCHS):
        state.set_epoch(epoch)
        for batch in batches(rank, world):
            opt.zero_grad()
            loss_of(ddp_model, batch).backward()
            opt.step()
    write_report(args.out, rank, world, model, bundle, state.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
