"""Data-parallel training of a small CNN on scikit-learn's digits with LEGACY-compressed gradients.

    horovodrun -np 4 -H localhost:4 python examples/train_digits.py
    horovodrun -np 4 -H localhost:4 python examples/train_digits.py --legacy-by epoch --group-compressions 5,1,0.5

Each worker trains on its own quarter of the training set. Gradients are compressed with Top-k
and error feedback, its density set by LEGACY from the layer's size and the epoch; the flags use
the reference implementation's format (densities in percent, comma-separated, ';' between phases
for --legacy-by both). By default layers under 1,000 elements are sent dense, those under 10,000
at 10% and larger ones at 1%. At the end rank 0 prints the test accuracy and the bytes this rank
sent compared with an uncompressed allreduce.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import grace_legacy  # noqa: F401  (makes hvd.DistributedOptimizer accept grace_legacy compression)
from grace_legacy import Grace, Legacy, NoMemory, Residual, TopK


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


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
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    (x_train, y_train), (x_test, y_test) = load_split(args.seed)
    shard = slice(hvd.rank(), None, hvd.size())
    x_train, y_train = x_train[shard], y_train[shard]

    model = DigitsCNN()
    schedule = Legacy.from_strings(TopK(), args.legacy_by, group_compressions=args.group_compressions,
                                   group_splits=args.group_splits if args.legacy_by != "epoch" else "",
                                   epochs=args.epochs)
    compression = Grace(schedule, memory=NoMemory() if args.no_memory else Residual())
    if hvd.rank() == 0:
        print(compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Every rank must take the same number of steps: Horovod waits for all of them.
    steps = len(y_train) // args.batch_size
    generator = torch.Generator().manual_seed(args.seed + hvd.rank())
    epochs = tqdm(range(args.epochs), desc="epochs", disable=hvd.rank() != 0)
    for epoch in epochs:
        compression.set_epoch(epoch)
        model.train()
        order = torch.randperm(len(y_train), generator=generator)
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
        epochs.set_postfix(loss=f"{loss.item():.3f}")

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    stats = compression.stats
    if hvd.rank() == 0:
        for dimension in ("group", "phase"):
            for key, part in stats.get(dimension, {}).items():
                print(f"  {dimension} {key}: {part['tensors']} tensors sent, volume {part['volume']:.2%}")
        print(f"test accuracy {accuracy:.2%} | {hvd.size()} workers | rank 0 sent {stats['bytes_sent'] / 1e6:.3f} MB "
              f"vs {stats['bytes_dense'] / 1e6:.3f} MB dense: volume {stats['volume']:.2%}")


if __name__ == "__main__":
    main()
