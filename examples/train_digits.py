"""Data-parallel training of a small CNN on scikit-learn's digits with LEGACY-compressed gradients.

    horovodrun -np 4 -H localhost:4 python examples/train_digits.py
    horovodrun -np 4 -H localhost:4 python examples/train_digits.py --legacy-by epoch --group-compressions 5,1,0.5
    torchrun --nproc-per-node 4 examples/train_digits.py --backend ddp

With ``--backend ddp`` the model is wrapped in PyTorch's ``DistributedDataParallel`` (Gloo) and
the compression is its communication hook (``grace_legacy.ddp.register``); Horovod need not be
installed.

Each worker trains on its own quarter of the training set. Gradients are compressed with Top-k
and error feedback, its density set by LEGACY from the layer's size and the epoch; the flags use
the reference implementation's format (densities in percent, comma-separated, ';' between phases
for --legacy-by both). By default layers under 1,000 elements are sent dense, those under 10,000
at 10% and larger ones at 1%. At the end rank 0 prints the test accuracy and the bytes this rank
sent compared with an uncompressed allreduce. Progress is tqdm's bar on a terminal; under
``horovodrun``, ``torchrun`` or a pipe (no terminal) it is a plain line per epoch, at most one
every ``--progress-every`` seconds and always after the last epoch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import grace_legacy  # noqa: F401  (makes hvd.DistributedOptimizer accept grace_legacy compression)
import grace_legacy.ddp
from grace_legacy import Grace, Legacy, NoMemory, Residual, TopK

try:
    import horovod.torch as hvd
except ImportError:  # --backend ddp needs only PyTorch
    hvd = None


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class EpochProgress:
    """Iterates over the epochs and shows how far training is, on rank 0 (``enabled``).

    On a terminal: tqdm's bar. Without one (horovodrun and torchrun pipe every worker's output and
    prefix each line with its rank) tqdm's carriage-return redraws would pile up into one long line,
    so instead a plain line, ``epoch 5/20 | loss 0.123 | 3.1 s``, at most every ``every`` seconds
    and after the last epoch."""

    def __init__(self, epochs: int, enabled: bool, every: float = 5.0) -> None:
        self.epochs, self.enabled, self.every = epochs, enabled, every
        self.postfix = ""
        self.bar = tqdm(range(epochs), desc="epochs", disable=not enabled) if sys.stderr.isatty() else None

    def __iter__(self):
        if self.bar is not None:
            yield from self.bar
            return
        start = shown = time.monotonic()
        for epoch in range(self.epochs):
            yield epoch
            now = time.monotonic()
            if self.enabled and (now - shown >= self.every or epoch == self.epochs - 1):
                print(f"epoch {epoch + 1}/{self.epochs} | {self.postfix} | {now - start:.1f} s", flush=True)
                shown = now

    def set_postfix(self, **values: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**values)
        self.postfix = " | ".join(f"{key} {value}" for key, value in values.items())


def load_split(seed: int = 0):
    """The 1,797 8x8 digits, scaled to [0, 1], split 80/20 the same way on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by the number of workers")
    parser.add_argument("--legacy-by", choices=["uniform", "layer", "epoch", "both"], default="layer")
    parser.add_argument("--group-compressions", default="100,10,1",
                        help="Top-k densities in percent per size group (';' separates phases for 'both')")
    parser.add_argument("--group-splits", default="1000,10000", help="size-group thresholds in elements")
    parser.add_argument("--no-memory", action="store_true", help="turn error feedback off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress-every", type=float, default=5.0,
                        help="seconds between progress lines when the output is not a terminal")
    parser.add_argument("--backend", choices=["horovod", "ddp"], default="horovod",
                        help="horovodrun and hvd.DistributedOptimizer, or torchrun and DistributedDataParallel")
    return parser.parse_args()


def distribute(args, model: nn.Module, optimizer: torch.optim.Optimizer, compression: Grace):
    """(rank, size, the model to train, the optimizer to step) on the chosen backend."""
    if args.backend == "ddp":
        dist.init_process_group("gloo")
        ddp_model = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        grace_legacy.ddp.register(ddp_model, compression)  # the one line DDP users add
        return dist.get_rank(), dist.get_world_size(), ddp_model, optimizer
    if hvd is None:
        raise SystemExit("--backend horovod needs Horovod installed; use --backend ddp under torchrun")
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return hvd.rank(), hvd.size(), model, optimizer


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    model = DigitsCNN()
    schedule = Legacy.from_flags(TopK(), args.legacy_by, group_compressions=args.group_compressions,
                                   group_splits=args.group_splits if args.legacy_by != "epoch" else "",
                                   epochs=args.epochs)
    compression = Grace(schedule, memory=NoMemory() if args.no_memory else Residual())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    rank, size, trained, optimizer = distribute(args, model, optimizer, compression)
    for group in optimizer.param_groups:
        group["lr"] = args.lr * size
    if rank == 0:
        print(compression)

    (x_train, y_train), (x_test, y_test) = load_split(args.seed)
    shard = slice(rank, None, size)
    x_train, y_train = x_train[shard], y_train[shard]

    # Every rank must take the same number of steps: the collectives wait for all of them.
    steps = len(y_train) // args.batch_size
    generator = torch.Generator().manual_seed(args.seed + rank)
    epochs = EpochProgress(args.epochs, enabled=rank == 0, every=args.progress_every)
    for epoch in epochs:
        compression.set_epoch(epoch)
        model.train()
        order = torch.randperm(len(y_train), generator=generator)
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(trained(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
        epochs.set_postfix(loss=f"{loss.item():.3f}")

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    stats = compression.stats
    if rank == 0:
        for dimension in ("group", "phase"):
            for key, part in stats.get(dimension, {}).items():
                print(f"  {dimension} {key}: {part['tensors']} tensors sent, volume {part['volume']:.2%}")
        workers = f"{size} workers" + (" (DDP)" if args.backend == "ddp" else "")
        print(f"test accuracy {accuracy:.2%} | {workers} | rank 0 sent {stats['bytes_sent'] / 1e6:.3f} MB "
              f"vs {stats['bytes_dense'] / 1e6:.3f} MB dense: volume {stats['volume']:.2%}")


if __name__ == "__main__":
    main()
