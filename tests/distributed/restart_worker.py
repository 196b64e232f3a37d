"""DDP training with LEGACY Top-k and error feedback under ``torchrun --max-restarts``, resuming from
its last checkpoint after a worker is killed.

Every ``--every`` steps the ranks gather their compression states (``GraceState.state_dict()``,
which differ by rank) and rank 0 writes the model, the optimizer, every rank's compression state
and the step to ``--checkpoint`` (written aside, then renamed, so the file is always whole). At
start, a process that finds a checkpoint loads it, each rank its own compression state.
``--control-from STEP``: at the end, train again from the checkpoint of STEP with everything but
the compression state restored (new model, optimizer, DDP wrapper and hook state in the same
processes), and record that digest too: the control. ``--kill-step``,
``--kill-rank``, ``--kill-point`` and ``--kill-index``: in the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0), that rank SIGKILLs itself at that step: in the backward pass as
parameter ``--kill-index``'s gradient is computed (``backward``), after the optimizer step
(``step``), or as the checkpoint's states are being gathered (``checkpoint``).

Every process appends ``enter`` (attempt, step it starts from), ``done`` (parameter digest,
compression volume and routes) and ``control`` (parameter digest) records to ``<out>/records-<rank>.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from grace_legacy import Grace, Legacy, Residual, TopK

GLOBAL_BATCH = 48


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--kill-point", choices=["backward", "step", "checkpoint"], default="backward")
    parser.add_argument("--kill-index", type=int, default=0)
    parser.add_argument("--control-from", type=int, default=-1)
    return parser.parse_args()


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    return x[rank::size], y[rank::size]


def build(checkpoint: dict | None, rank: int, load_compression: bool = True):
    """Model, optimizer, DDP wrapper and hook state, as a fresh process builds them, from
    ``checkpoint`` where given (each rank its own compression state)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        sgd.load_state_dict(checkpoint["optimizer"])
    # Small DDP buckets, so that a step's buckets are on their way while the backward pass goes on.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)
    state = grace_legacy.ddp.register(ddp, Grace(Legacy(TopK(), by="layer", values=[1.0, 0.05], splits=[1000]),
                                                 memory=Residual()))
    if checkpoint is not None and load_compression:
        state.load_state_dict(checkpoint["compression"][rank])
    return model, sgd, ddp, state


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)

    def record(event: str, **fields) -> None:
        with (args.out / f"records-{rank}.jsonl").open("a") as f:
            f.write(json.dumps({"event": event, "rank": rank, "size": size, "attempt": attempt, **fields}) + "\n")

    checkpoint = torch.load(args.checkpoint, weights_only=True) if args.checkpoint.exists() else None
    model, sgd, ddp, state = build(checkpoint, rank)
    start = 0 if checkpoint is None else checkpoint["step"]
    record("enter", step=start)

    kill_now = {"armed": False}

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_in_backward(grad: torch.Tensor) -> torch.Tensor:
        if kill_now["armed"]:
            die()
        return grad

    list(model.parameters())[args.kill_index].register_hook(kill_in_backward)

    def train_step(model, sgd, ddp, step: int) -> None:
        x, y = batch(step, rank, size)
        sgd.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        sgd.step()

    kept = None
    for step in range(start, args.steps):
        kill_here = attempt == 0 and rank == args.kill_rank and step == args.kill_step
        kill_now["armed"] = kill_here and args.kill_point == "backward"
        train_step(model, sgd, ddp, step)
        if kill_here and args.kill_point == "step":
            die()
        if (step + 1) % args.every == 0:
            if kill_here and args.kill_point == "checkpoint":
                die()
            states = [None] * size
            dist.all_gather_object(states, state.state_dict())
            saved = {"model": model.state_dict(), "optimizer": sgd.state_dict(), "compression": states,
                     "step": step + 1}
            if rank == 0:
                aside = args.checkpoint.with_suffix(".tmp")
                torch.save(saved, aside)
                os.replace(aside, args.checkpoint)
            if step + 1 == args.control_from:
                kept = copy.deepcopy(saved)
            dist.barrier()
    stats = state.stats
    record("done", step=args.steps, digest=digest(model), volume=stats["volume"], routes=stats["tensors_by_route"])
    if kept is not None:
        # The control: from the checkpoint kept, everything but the compression state restored.
        model, sgd, ddp, _ = build(kept, rank, load_compression=False)
        for step in range(kept["step"], args.steps):
            train_step(model, sgd, ddp, step)
        record("control", step=args.steps, digest=digest(model))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
