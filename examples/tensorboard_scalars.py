"""Logging grace_legacy's traffic to TensorBoard: ``compression.scalars()`` each epoch, beside the loss.

    torchrun --nproc-per-node 4 examples/tensorboard_scalars.py --logdir runs/digits
    python examples/tensorboard_scalars.py --logdir runs/digits      # one process
    tensorboard --logdir runs/digits

The digits CNN of ``train_digits.py``, under ``DistributedDataParallel`` (Gloo) with
``grace_legacy.ddp.register``, LEGACY by layer and epoch over Top-k with error feedback. At the end
of every epoch rank 0 writes ``state.scalars()`` (``grace/volume``, ``grace/wire_bytes``,
``grace/group/<g>/volume``, ``grace/phase/<p>/volume``, ...: ``compression.stats`` flattened) and
the mean loss with ``torch.utils.tensorboard.SummaryWriter``, then resets the stats, so each point
is that epoch's traffic. W&B takes the same dictionary: ``wandb.log(state.scalars(), step=epoch)``.
Needs the ``tensorboard`` package (``pip install grace-legacy[tensorboard]``); runs offline.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from train_digits import DigitsCNN, load_split

import grace_legacy.ddp
from grace_legacy import Grace, Legacy, Residual, TopK


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", type=Path, default=Path("runs/digits"), help="where the event file goes")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by the number of workers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        parser.error("--epochs and --batch-size must be positive integers and --lr a positive number")
    return args


def init_process_group() -> None:
    """Gloo, from torchrun's environment; one process on a free local port when started without it."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()

    model = DistributedDataParallel(DigitsCNN())
    # Small layers dense; the rest at 10% and 1% in the first half of training, 5% and 0.5% after.
    schedule = Legacy(TopK(), by="both", values=[[1.0, 0.1, 0.01], [1.0, 0.05, 0.005]], splits=[1000, 10000],
                      epochs=args.epochs)
    state = grace_legacy.ddp.register(model, Grace(schedule, memory=Residual()))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    (x_train, y_train), _ = load_split(args.seed)
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    steps = len(y_train) // args.batch_size  # the same on every rank: the collectives wait for all
    generator = torch.Generator().manual_seed(args.seed + rank)
    writer = SummaryWriter(args.logdir) if rank == 0 else None
    for epoch in range(args.epochs):
        state.set_epoch(epoch)
        order = torch.randperm(len(y_train), generator=generator)
        total = 0.0
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            total += loss.item()
        if writer is not None:
            writer.add_scalar("train/loss", total / steps, epoch)
            for key, value in state.scalars(prefix="grace").items():
                writer.add_scalar(key, value, epoch)
            print(f"epoch {epoch + 1}/{args.epochs} | loss {total / steps:.3f} | "
                  f"volume {state.stats['volume']:.2%}", flush=True)
        state.reset_stats()
    if writer is not None:
        writer.close()
        print(f"TensorBoard event file in {args.logdir}: tensorboard --logdir {args.logdir}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
