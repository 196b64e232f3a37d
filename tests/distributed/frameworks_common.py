"""What the Lightning, Fabric, Accelerate and plain-DDP workers share, so that their runs can be
compared bit for bit: one tiny model, each rank's batches, the compression, the optimizer, and the
report each rank writes (``<out>/rank<r>.pt``: final parameters, stats, scalars, hook steps).

The compression is LEGACY by layer and epoch over Top-k with error feedback: the biases (under 100
elements) go dense, the weights at density 0.25 in epoch 0 and 0.05 from epoch 1 on, so the
schedule only matches the plain run if the framework's run enters epoch 1 when it should.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from grace_legacy import Grace, Legacy, Residual, TopK

SEED = 0
EPOCHS = 2
STEPS = 3  # per epoch, on every rank
BATCH = 8
FEATURES, CLASSES = 24, 4
LR = 0.1


def compression() -> Grace:
    return Grace(Legacy(TopK(), by="both", values=[[1.0, 0.25], [1.0, 0.05]], splits=[100], boundaries=[1]),
                 memory=Residual())


def build_net() -> nn.Sequential:
    """The same initial weights in every worker (DDP broadcasts rank 0's anyway)."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


class Tiny(nn.Module):
    """The model as plain PyTorch, its parameters named as in the LightningModule (``net.0.weight``...):
    the per-tensor compression state is keyed by these names."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``STEPS * BATCH`` samples (contiguous, so a DataLoader's batches are the same bits)."""
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(world * STEPS * BATCH, FEATURES, generator=generator)
    y = x[:, :CLASSES].argmax(1)
    return x[rank::world].contiguous(), y[rank::world].contiguous()


def batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of this rank's batches, in order (what ``DataLoader(shuffle=False)`` yields)."""
    x, y = shard(rank, world)
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(y), BATCH)]


def optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=LR, momentum=0.9)


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def write_report(out: Path, rank: int, world: int, module: nn.Module, compression: Grace, hook_steps: int,
                 **extra) -> None:
    """What the test compares: this rank's final parameters (by name) and what the compression recorded."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"rank": rank, "world": world, "hook_steps": hook_steps, "stats": compression.stats,
                "scalars": compression.scalars(),
                "parameters": {name: p.detach().clone() for name, p in module.named_parameters()}, **extra},
               out / f"rank{rank}.pt")
