"""The accuracy benchmarks' training, shared by the study, the paper's tables and the long run:
one run of one arm on one task (inside a ``horovodrun`` worker), and the loop over seeds and arms
that a worker runs.

Runs are paired by seed: every arm of a seed starts from the same initial weights (``torch``
seeded with the seed before the model is built) and draws the same batches (each rank's order
from a generator seeded with the seed and the rank), so arms differ only in how they compress.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn
from tqdm import tqdm

from grace_legacy import Grace
from grace_legacy.backends.horovod import synchronize

from .arms import Arm, Run
from .tasks import Task, evaluate, loss_of


def broadcast_parameters(state: dict[str, torch.Tensor], root_rank: int = 0) -> None:
    """``hvd.broadcast_parameters``, its ranks waiting asleep: Horovod's own wait spins, and ranks
    that arrive first would take the cores of the ranks still building their model."""
    handles = [hvd.broadcast_async_(tensor, root_rank, name=f"broadcast.{name}")
               for name, tensor in sorted(state.items())]
    for handle in handles:
        synchronize(handle)


def learning_rate(task: Task, epoch: int, epochs: int) -> float:
    """The per-worker rate scaled by the workers (for SGD), divided by ``task.decay`` at each
    milestone (a fraction of the run) that ``epoch`` has reached: a step decay."""
    base = task.lr * hvd.size() if task.optimizer == "sgd" else task.lr
    drops = sum(1 for milestone in task.milestones if epoch >= milestone * epochs)
    return base / task.decay**drops


def _lr_listener(compression: Any) -> Callable[[float], None] | None:
    """An adaptive schedule that wants the learning rate (Accordion treats a drop as critical)."""
    return getattr(getattr(compression, "compressor", None), "set_lr", None)


def train_one(task: Task, arm: Arm, seed: int, build: Callable[[], nn.Module], train, test,
              epochs: int) -> dict[str, Any]:
    """Train ``build()`` for ``epochs`` with ``arm``'s compression; the run's record."""
    torch.manual_seed(seed)
    model = build()
    x_all, y_all = train
    shard = slice(hvd.rank(), None, hvd.size())
    x_train, y_train = x_all[shard], y_all[shard]
    # Every rank must take the same number of steps: Horovod waits for all of them.
    steps = len(x_all) // hvd.size() // task.batch_size
    compression = arm.build(Run(model, task, epochs, steps, hvd.size(), seed))
    if task.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate(task, 0, epochs), momentum=0.9,
                                    weight_decay=task.weight_decay)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=task.lr, weight_decay=task.weight_decay)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    broadcast_parameters(model.state_dict())
    generator = torch.Generator().manual_seed(1000 * seed + hvd.rank())
    tell_lr = _lr_listener(compression)
    curve, volumes = [], []
    start = time.perf_counter()
    for epoch in range(epochs):
        if hasattr(compression, "set_epoch"):
            compression.set_epoch(epoch)
        lr = learning_rate(task, epoch, epochs)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if tell_lr is not None:
            tell_lr(lr)
        order = torch.randperm(len(y_train), generator=generator)
        for step in range(steps):
            batch = order[step * task.batch_size:(step + 1) * task.batch_size]
            optimizer.zero_grad()
            loss_of(task, model, x_train[batch], y_train[batch]).backward()
            optimizer.step()
        curve.append(evaluate(task, model, test))
        if isinstance(compression, Grace):
            volumes.append(compression.stats["volume"])
    wall = time.perf_counter() - start
    stats = compression.stats if isinstance(compression, Grace) else {"volume": 1.0, "tensors_by_route": {}}
    return {"task": task.name, "arm": arm.name, "family": arm.family, "error_feedback": arm.error_feedback,
            "seed": seed, "metric": task.metric, "final": curve[-1], "curve": curve, "volume": stats["volume"],
            # The running volume after each epoch (the run's bytes so far / dense bytes so far).
            "volume_curve": volumes or [1.0] * epochs,
            "routes": stats.get("tensors_by_route", {}),
            "by_group": {str(k): v["volume"] for k, v in stats.get("group", {}).items()},
            "wall_s": wall, "epochs": epochs, "steps_per_epoch": steps}


def run_arms(task: Task, arms: Sequence[Arm], seeds: int, build: Callable[[], nn.Module], train, test,
             epochs: int, on_run: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every arm for every seed, seed by seed (rank 0 shows progress and hands ``on_run`` the
    records so far after each run, e.g. to save them); the records."""
    # What the imports made (torch's objects, a few hundred thousand) lives as long as the worker: set it
    # aside from the garbage collector, which would walk it again in every full collection.
    gc.freeze()
    runs = []
    progress = tqdm(total=seeds * len(arms), desc=task.name, disable=hvd.rank() != 0, mininterval=5)
    for seed in range(seeds):
        for arm in arms:
            record = train_one(task, arm, seed, build, train, test, epochs)
            runs.append(record)
            progress.update()
            if hvd.rank() == 0:
                if on_run is not None:
                    on_run(runs)
                progress.write(f"[{task.name}] seed {seed} {arm.name}: {task.metric} {record['final']:.4f}, "
                               f"volume {record['volume']:.4f}, {record['wall_s']:.1f} s")
    progress.close()
    return runs
