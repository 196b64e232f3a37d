"""Data-parallel training of a small CNN on scikit-learn's digits with compressed gradients.

    horovodrun -np 4 -H localhost:4 python examples/train_digits.py

Each worker trains on its own quarter of the training set; gradients are compressed with
Top-k and error feedback before they cross the network. At the end rank 0 prints the
test accuracy and the bytes this rank sent compared with an uncompressed allreduce.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import grace_legacy  # noqa: F401  (makes hvd.DistributedOptimizer accept grace_legacy compression)
from grace_legacy import Grace, Residual, TopK


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
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-k density")
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
    compression = Grace(TopK(args.ratio), memory=Residual())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Every rank must take the same number of steps: Horovod waits for all of them.
    steps = len(y_train) // args.batch_size
    generator = torch.Generator().manual_seed(args.seed + hvd.rank())
    epochs = tqdm(range(args.epochs), desc="epochs", disable=hvd.rank() != 0)
    for _epoch in epochs:
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
        print(f"test accuracy {accuracy:.2%} | {hvd.size()} workers | rank 0 sent {stats['bytes_sent'] / 1e6:.3f} MB "
              f"vs {stats['bytes_dense'] / 1e6:.3f} MB dense: volume {stats['volume']:.2%}")


if __name__ == "__main__":
    main()
