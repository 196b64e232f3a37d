"""A run checkpointed at step N and resumed in fresh processes ends bit-identical
to an uninterrupted run, for each set-up of ``tests.registry.RESUME_SETUPS``.

Two launches share ``--out``:

* ``--phase first``: per set-up, an uninterrupted run of ``RESUME_STEPS`` steps (its parameters
  and final compression state are saved per rank), and a separate run of ``RESUME_AT`` steps
  that checkpoints the way docs/CHECKPOINTING.md tells users to: the compression
  states gathered to rank 0, saved with the model and the optimizer in one file.
* ``--phase resume`` (fresh processes): per set-up, the checkpoint is read back with
  ``torch.load(..., weights_only=True)``, the remaining steps are trained, and the parameters
  must equal the uninterrupted run's bit for bit, and the compression state (byte counts, step
  counters, residuals, schedule decisions) must equal its final one. A control run that restores
  the model and optimizer but not the compression must end elsewhere: it shows the test would
  notice a state that ``state_dict`` forgot.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch

from tests.distributed.checks import Recorder, parse_args
from tests.distributed.harness import Net, batch, loss_of
from tests.registry import LR, RESUME_AT, RESUME_SETUPS, RESUME_STEPS

#: Wall-clock measurements, which no resume can reproduce.
UNCOMPARED = {"timing"}


def build(label: str, factory):
    torch.manual_seed(0)
    model = Net()
    # DGC's memory keeps the momentum itself (plain SGD); elsewhere the optimizer has state too.
    momentum = 0.0 if "DGC" in label else 0.9
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    compression = factory()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    return model, optimizer, compression


def train(model, optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_of(model, batch(step, hvd.rank())).backward()
        optimizer.step()


def differences(a, b, path: str = "") -> list[str]:
    """Where two nested states differ (tensors compared bit for bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a if k not in UNCOMPARED for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [f"{path}: tensors differ"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def first(rec: Recorder, index: int, label: str, factory) -> None:
    out = rec.out
    model, optimizer, compression = build(label, factory)
    train(model, optimizer, range(RESUME_STEPS))
    torch.save({"parameters": {n: p.detach().clone() for n, p in model.named_parameters()},
                "compression": compression.state_dict()}, out / f"uninterrupted{index}.rank{hvd.rank()}.pt")

    model, optimizer, compression = build(label, factory)
    train(model, optimizer, range(RESUME_AT))
    states = hvd.allgather_object(compression.state_dict(), name=f"checkpoint{index}")
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "compression": states},
                   out / f"checkpoint{index}.pt")
    rec.check(f"{label}: checkpointed", True)


def resume(rec: Recorder, index: int, label: str, factory) -> None:
    out = rec.out
    checkpoint = torch.load(out / f"checkpoint{index}.pt", weights_only=True)
    uninterrupted = torch.load(out / f"uninterrupted{index}.rank{hvd.rank()}.pt", weights_only=True)

    model, optimizer, compression = build(label, factory)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    compression.load_state_dict(checkpoint["compression"][hvd.rank()])
    train(model, optimizer, range(RESUME_AT, RESUME_STEPS))
    differing = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), uninterrupted["parameters"][n])]
    rec.check(f"{label}: resumed parameters bit-identical to the uninterrupted run's", not differing,
              f"differ: {differing}")
    diff = differences(compression.state_dict(), uninterrupted["compression"])
    rec.check(f"{label}: resumed compression state equal to the uninterrupted run's", not diff, "; ".join(diff[:5]))

    model, optimizer, compression = build(label, factory)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(model, optimizer, range(RESUME_AT, RESUME_STEPS))
    rec.check(f"{label}: control: without the compression state the run ends elsewhere",
              any(not torch.equal(p.detach(), uninterrupted["parameters"][n]) for n, p in model.named_parameters()))


def main() -> None:
    args = parse_args([(("--phase",), {"choices": ["first", "resume"], "required": True})])
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    rec.out.mkdir(parents=True, exist_ok=True)
    run = first if args.phase == "first" else resume
    for index, (label, factory) in enumerate(RESUME_SETUPS):
        rec.guard(label, run, rec, index, label, factory)
    rec.extra["setups"] = [label for label, _ in RESUME_SETUPS]
    rec.write()


if __name__ == "__main__":
    main()
