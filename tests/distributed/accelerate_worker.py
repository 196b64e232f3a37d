"""A user's Accelerate script (``accelerate launch --num_processes N``), on CPU: Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own hooks, so grace_legacy's is
registered on the model ``accelerator.prepare`` returns, the recipe of docs/DDP.md#accelerate.
Each rank writes the shared report (frameworks_common.py) for the test to compare with the plain
torchrun run."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator

import grace_legacy.ddp
from tests.distributed.frameworks_common import EPOCHS, Tiny, batches, compression, loss_of, optimizer, write_report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    model = Tiny()
    prepared, opt = accelerator.prepare(model, optimizer(model.parameters()))
    bundle = compression()
    state = grace_legacy.ddp.register(prepared, bundle)  # the prepared model: Accelerate's DDP
    rank, world = accelerator.process_index, accelerator.num_processes
    for epoch in range(EPOCHS):
        state.set_epoch(epoch)
        for batch in batches(rank, world):
            opt.zero_grad()
            accelerator.backward(loss_of(prepared, batch))
            opt.step()
    write_report(args.out, rank, world, model, bundle, state.steps, distributed_type=str(accelerator.distributed_type))
    accelerator.end_training()


if __name__ == "__main__":
    main()
