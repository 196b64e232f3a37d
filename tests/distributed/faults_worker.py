"""Faults, run on every rank under horovodrun: disagreeing ranks, unused parameters, a killed rank.

``--scenario agreement`` runs, in order:

1. unused parameters: ranks 1 and 3 never use one branch of the model, and no rank uses another
   parameter; the synchronized gradients must equal an independent reference (Top-k) or at least
   agree bit for bit across ranks (PowerSGD, whose rounds must not deadlock);
2. rank 2 builds a different LEGACY schedule: every rank must raise ``RanksDisagree`` when the
   optimizer is built;
3. rank 2 enters another epoch than the others: every rank must raise it at the first step;
4. rank 2 builds a model with an extra layer: every rank raises at construction and, this time,
   lets the error end the process, so the test can see every rank exit non-zero.

``--scenario dead``: rank 2 kills itself (SIGKILL) at step 3, after writing the time; the other
ranks go on training, and the test measures how long the whole job takes to end.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time

import horovod.torch as hvd
import torch
from torch import nn

from grace_legacy import Grace, Legacy, NoMemory, PowerSGD, RanksDisagree, TopK
from tests.distributed.checks import Recorder, gather_from_ranks, mean_of, parse_args, topk_contribution

RATIO = 0.3
STEPS = 2


class Branchy(nn.Module):
    """A trunk, a branch only some ranks take, and a parameter no rank uses."""

    def __init__(self, extra_layer: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.never = nn.Parameter(torch.ones(4))
        self.extra = nn.Linear(8, 8) if extra_layer else None

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        if self.extra is not None:
            h = self.extra(h)
        return self.head(h)


def takes_branch(rank: int) -> bool:
    return rank % 2 == 0


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + hvd.rank())
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    return nn.functional.cross_entropy(model(x, takes_branch(hvd.rank())), y)


def build(compression, extra_layer: bool = False):
    torch.manual_seed(0)
    model = Branchy(extra_layer)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def unused_parameters(rec: Recorder, label: str, compression, contribution) -> None:
    """Train ``STEPS`` steps; ``contribution(grad)`` is what a rank adds to the mean (``None``:
    only check that every rank holds the same gradient)."""
    model, opt = build(compression)
    for step in range(STEPS):
        opt.zero_grad()
        # This rank's own gradients, from a private copy that carries none of Horovod's hooks.
        twin = copy.deepcopy(model)
        local = dict(zip(model.parameters(), torch.autograd.grad(loss_at(twin, step), list(twin.parameters()),
                                                                 allow_unused=True), strict=True))
        loss_at(model, step).backward()
        rec.check(f"{label}: step {step} branch grad is None before synchronize on ranks that skip it",
                  (model.branch.weight.grad is None) != takes_branch(hvd.rank()))
        opt.synchronize()
        for name, p in model.named_parameters():
            own = local[p] if local[p] is not None else torch.zeros_like(p)
            everyone = gather_from_ranks(p.grad)
            rec.check(f"{label}: step {step} {name} identical on every rank",
                      all(torch.equal(g, everyone[0]) for g in everyone))
            if contribution is not None:
                rec.close(p.grad, mean_of(gather_from_ranks(contribution(own))), f"{label}: step {step} {name}")
        rec.check(f"{label}: step {step} never-used parameter has a zero gradient",
                  model.never.grad is not None and not model.never.grad.any())
        with opt.skip_synchronize():
            opt.step()


def expect_disagreement(rec: Recorder, label: str, run, *needles: str) -> None:
    try:
        run()
    except RanksDisagree as err:
        message = str(err)
        rec.extra.setdefault("messages", {})[label] = message
        missing = [n for n in needles if n not in message]
        rec.check(f"{label}: RanksDisagree names {needles}", not missing, message)
    else:
        rec.check(f"{label}: RanksDisagree raised", False, "no error")


def agreement(rec: Recorder) -> None:
    size = hvd.size()
    rec.guard("topk", unused_parameters, rec, "topk", Grace(TopK(RATIO), memory=NoMemory()),
              lambda g: topk_contribution(g, RATIO, size))
    # One tensor per collective, so PowerSGD's second round depends on the order of the waits.
    rec.guard("powersgd", unused_parameters, rec, "powersgd", Grace(PowerSGD(1), bucket_bytes=0), None)

    splits = [64] if hvd.rank() != 2 else [32]
    expect_disagreement(rec, "schedule", lambda: build(Legacy(TopK(), by="layer", values=[1.0, 0.1],
                                                              splits=splits)),
                        "compressor", "ranks 0, 1, 3", "splits=[64]", "rank 2", "splits=[32]")

    def another_epoch():
        schedule = Legacy(TopK(), by="epoch", values=[1.0, 0.1], epochs=2)
        model, opt = build(schedule)
        schedule.set_epoch(1 if hvd.rank() == 2 else 0)
        loss_at(model, 0).backward()
        opt.synchronize()

    expect_disagreement(rec, "epoch", another_epoch, "schedule progress", "ranks 0, 1, 3: 0", "rank 2: 1")

    # The last one is left uncaught: every rank must end non-zero with the message.
    try:
        build(Grace(TopK(RATIO)), extra_layer=hvd.rank() == 2)
    except RanksDisagree as err:
        rec.extra.setdefault("messages", {})["model"] = str(err)
        rec.write()
        raise
    rec.check("model: RanksDisagree raised", False, "no error")


def dead(rec: Recorder, out) -> None:
    model, opt = build(Grace(TopK(RATIO)))
    rec.write()  # proof that this rank got going
    for step in range(10**6):
        if step == 3 and hvd.rank() == 2:
            (out / "killed_at.json").write_text(json.dumps(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss_at(model, step).backward()
        opt.step()


def main() -> None:
    args = parse_args([(("--scenario",), {"choices": ["agreement", "dead"], "required": True})])
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    try:
        if args.scenario == "agreement":
            agreement(rec)
        else:
            dead(rec, args.out)
    finally:
        rec.write()


if __name__ == "__main__":
    main()
