"""A user's Lightning script, launched as a user launches it (``python lightning_worker.py``; Lightning
starts the other ranks itself): ``--mode trainer`` fits a ``LightningModule`` with
``Trainer(accelerator="cpu", devices=N, strategy=GraceDDPStrategy(compression))``, ``--mode fabric``
runs the same training as a Fabric loop with ``GraceFabricStrategy``. Each rank writes the shared
report (frameworks_common.py) for the test to compare with the plain torchrun run."""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from grace_legacy.lightning import GraceDDPStrategy, GraceFabricStrategy
from tests.distributed.frameworks_common import (
    BATCH,
    EPOCHS,
    STEPS,
    Tiny,
    batches,
    build_net,
    compression,
    loss_of,
    optimizer,
    shard,
    write_report,
)


class LitTiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = build_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return loss_of(self, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters())

    def train_dataloader(self) -> DataLoader:
        # Each rank's own shard, as the plain run reads it (no sampler injected: use_distributed_sampler=False).
        return DataLoader(TensorDataset(*shard(self.global_rank, self.trainer.world_size)), batch_size=BATCH)


def trainer_run(out: Path, devices: int) -> None:
    bundle = compression()
    strategy = GraceDDPStrategy(bundle, process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=EPOCHS,
                        limit_train_batches=STEPS, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out)
    model = LitTiny()
    trainer.fit(model)
    write_report(out, trainer.global_rank, trainer.world_size, model, bundle, strategy.grace_state.steps,
                 strategy_scalars=strategy.scalars("lightning"), epoch=strategy.grace.compressor.epoch)


def fabric_run(out: Path, devices: int) -> None:
    bundle = compression()
    strategy = GraceFabricStrategy(bundle)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    model = Tiny()
    wrapped, opt = fabric.setup(model, optimizer(model.parameters()))
    for epoch in range(EPOCHS):
        strategy.set_epoch(epoch)
        for batch in batches(fabric.global_rank, fabric.world_size):
            opt.zero_grad()
            fabric.backward(loss_of(wrapped, batch))
            opt.step()
    write_report(out, fabric.global_rank, fabric.world_size, model, bundle, strategy.grace_state.steps,
                 strategy_scalars=strategy.scalars("lightning"), epoch=strategy.grace.compressor.epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=["trainer", "fabric"], required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    (trainer_run if args.mode == "trainer" else fabric_run)(args.out, args.devices)


if __name__ == "__main__":
    main()
