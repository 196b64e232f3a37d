"""Sharded data-parallel training (FSDP2, ``fully_shard``) of a small CNN on scikit-learn's digits,
with the gradient reduce-scatter compressed by grace_legacy:

    torchrun --nproc-per-node 4 examples/train_digits_fsdp.py                          # QSGD, no memory
    torchrun --nproc-per-node 4 examples/train_digits_fsdp.py --compression topk-ef    # Top-k + error feedback
    torchrun --nproc-per-node 4 examples/train_digits_fsdp.py --compression dense      # FSDP2's own

Each block (features, classifier) and the whole model are FSDP units; ``grace_legacy.fsdp.register``
gives every unit the compressed reduce-scatter, and the parameter all-gather stays FSDP2's own.
Each worker trains on its own quarter of the training set (Gloo, CPU). At the end rank 0 prints the
test accuracy, the link bytes of the reduce-scatters against FSDP2's dense ones, and the memory the
compression keeps per rank against the gradient shard FSDP2 keeps (docs/FSDP.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import grace_legacy.fsdp
from grace_legacy import QSGD, Grace, Legacy, Residual, TopK, U8bit

#: The compressions this example offers, by name (``dense``: FSDP2's own reduce-scatter).
COMPRESSIONS = {
    "dense": lambda: None,
    "qsgd": lambda: QSGD(64),                                        # unbiased, memory-free, 1 byte an element
    "u8bit": U8bit,                                                  # memory-free, 1 byte an element
    "topk-ef": lambda: Grace(TopK(0.01), memory=Residual()),         # error feedback: a full-size residual
    "legacy-topk-ef": lambda: Grace(Legacy(TopK(), by="layer", values=[1.0, 0.1, 0.01], splits=[1000, 10000]),
                                    memory=Residual()),
}


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compression", choices=sorted(COMPRESSIONS), default="qsgd")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by the number of workers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write rank 0's results here")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> dict:
    """Train under torchrun's process group (initialized here if it is not yet); every rank returns
    its results: accuracy, the compression's stats and memory report (``None`` for dense)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    model = DigitsCNN()
    mesh = init_device_mesh("cpu", (size,))
    fully_shard(model.features, mesh=mesh)
    fully_shard(model.classifier, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compression = COMPRESSIONS[args.compression]()
    state = grace_legacy.fsdp.register(model, compression) if compression is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    (x_train, y_train), (x_test, y_test) = load_split(args.seed)
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    steps = len(y_train) // args.batch_size  # the same on every rank: the collectives wait for all
    generator = torch.Generator().manual_seed(args.seed + rank)
    for epoch in range(args.epochs):
        if state is not None:
            state.set_epoch(epoch)
        order = torch.randperm(len(y_train), generator=generator)
        for step in range(steps):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return {"accuracy": accuracy, "workers": size, "compression": args.compression, "steps": steps * args.epochs,
            "stats": None if state is None else state.stats,
            "memory": None if state is None else state.memory_report()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    result = train(args)
    if dist.get_rank() == 0:
        line = f"test accuracy {result['accuracy']:.2%} | {result['workers']} workers (FSDP2) | {args.compression}"
        stats, memory = result["stats"], result["memory"]
        if stats is not None:
            line += (f" | rank 0 put {stats['wire_bytes'] / 1e6:.3f} MB on its link vs {stats['wire_dense'] / 1e6:.3f}"
                     f" MB for FSDP2's reduce-scatter: volume {stats['volume']:.2%} | compression state "
                     f"{memory['state'] / 1e3:.1f} kB vs a {memory['gradient_shard'] / 1e3:.1f} kB gradient shard")
        print(line)
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
