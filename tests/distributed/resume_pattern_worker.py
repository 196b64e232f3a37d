"""Horovod's resume pattern, with grace_legacy imported, for every optimizer and compression.

Rank 0 loads a checkpoint (an optimizer state with entries), the other ranks start empty, and
``hvd.broadcast_optimizer_state`` gives everyone rank 0's state. Horovod lets the ranks whose
state is empty fill it with a *local* step, which it only dares take once it has recognised the
optimizer as one of Horovod's distributed ones; if the recognition fails, those ranks step
through the distributed optimizer (an allreduce the others never join) and the job hangs. The
launcher's timeout turns such a hang into a failure.

Checks, per (compression, optimizer): the call returns, every rank's optimizer state then equals
rank 0's (a digest of every tensor and number in it), a training step afterwards leaves every
rank's parameters bit-identical, and Horovod's own module attribute is still Horovod's function.
"""

from __future__ import annotations

import hashlib

import horovod.torch as hvd
import horovod.torch.optimizer
import torch

import grace_legacy
from grace_legacy import Grace, Legacy, Residual, TopK
from tests.distributed.checks import Recorder, parse_args
from tests.distributed.harness import Net, batch, loss_of

OPTIMIZERS = {
    "SGD(momentum)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-3),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
}

COMPRESSIONS = {
    "hvd.Compression.none": lambda: hvd.Compression.none,
    "hvd.Compression.fp16": lambda: hvd.Compression.fp16,
    "TopK(0.1)": lambda: TopK(0.1),
    "Legacy(TopK) by both + Residual": lambda: Grace(
        Legacy(TopK(), by="both", values=[[1.0, 0.2], [0.5, 0.05]], splits=[100], epochs=2), memory=Residual()),
}


def state_digest(optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of every tensor and number of an optimizer's state, in a fixed order."""
    h = hashlib.sha256()
    state = optimizer.state_dict()["state"]
    for key in sorted(state):
        for field in sorted(state[key]):
            value = state[key][field]
            h.update(f"{key}.{field}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().to(torch.float64).contiguous().numpy().tobytes())
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def checkpoint_of(optimizer_label: str) -> dict:
    """An optimizer state with entries, as rank 0 would read it from a checkpoint: two local
    steps of a separate model and optimizer of the same shapes."""
    torch.manual_seed(1)
    model = Net()
    optimizer = OPTIMIZERS[optimizer_label](model.parameters())
    for step in range(2):
        optimizer.zero_grad()
        loss_of(model, batch(step, 0)).backward()
        optimizer.step()
    return optimizer.state_dict()


def resume(rec: Recorder, compression_label: str, optimizer_label: str) -> None:
    label = f"{compression_label}/{optimizer_label}"
    torch.manual_seed(0)
    model = Net()
    optimizer = hvd.DistributedOptimizer(OPTIMIZERS[optimizer_label](model.parameters()),
                                         named_parameters=model.named_parameters(),
                                         compression=COMPRESSIONS[compression_label]())
    if hvd.rank() == 0:
        optimizer.load_state_dict(checkpoint_of(optimizer_label))
    # Adagrad fills its state at construction; the others only at their first step.
    eager = bool(OPTIMIZERS[optimizer_label](Net().parameters()).state_dict()["state"])
    rec.check(f"{label}: only rank 0's state has entries before the broadcast",
              eager or bool(optimizer.state_dict()["state"]) == (hvd.rank() == 0))
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    rec.check(f"{label}: broadcast_optimizer_state returned", True)
    # After the optimizer state, not before: the local step that fills an empty state applies
    # weight decay (AdamW, ASGD) even to a zero gradient, in Horovod with or without grace_legacy.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    digests = hvd.allgather_object(state_digest(optimizer))
    rec.check(f"{label}: every rank holds rank 0's optimizer state", len(set(digests)) == 1, str(digests))
    optimizer.zero_grad()
    loss_of(model, batch(5, hvd.rank())).backward()
    optimizer.step()
    digests = hvd.allgather_object(params_digest(model))
    rec.check(f"{label}: parameters bit-identical after a step", len(set(digests)) == 1, str(digests))


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    rec.check("horovod.torch.optimizer.DistributedOptimizer is still Horovod's own",
              horovod.torch.optimizer.DistributedOptimizer.__module__ == "horovod.torch.optimizer")
    rec.check("hvd.DistributedOptimizer is grace_legacy's", grace_legacy.optimizer.installed())
    for compression_label in COMPRESSIONS:
        for optimizer_label in OPTIMIZERS:
            rec.guard(f"{compression_label}/{optimizer_label}", resume, rec, compression_label, optimizer_label)
    rec.write()


if __name__ == "__main__":
    main()
