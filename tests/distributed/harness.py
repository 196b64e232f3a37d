"""A small model and the train-and-compare loop that distributed workers share."""

from __future__ import annotations

import copy

import horovod.torch as hvd
import torch
from torch import nn

from tests.distributed.checks import Recorder, gather_from_ranks, mean_of

STEPS = 3



class Net(nn.Module):
    """Parameters of many shapes, a 0-dim one and a 1-element one among them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.fc1 = nn.Linear(24, 40)
        self.fc2 = nn.Linear(40, 5)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.tensor([0.25]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h))) * self.scale + self.shift


def batch(step: int, rank: int, pass_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + pass_index)
    return torch.randn(8, 2, 8, generator=g), torch.randint(0, 5, (8,), generator=g)


def loss_of(model: nn.Module, data) -> torch.Tensor:
    """The loss of ``model`` on ``data``, the inputs cast to the model's dtype (a model trained in
    fp16 or bf16 sees the same batches rounded)."""
    x, y = data
    return nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)), y)


def local_gradients(model: nn.Module, step: int, passes: int) -> dict[str, torch.Tensor]:
    """This rank's own gradient, summed over ``passes`` backward passes, on a private copy."""
    twin = copy.deepcopy(model)
    total = {name: torch.zeros_like(p) for name, p in twin.named_parameters()}
    for i in range(passes):
        grads = torch.autograd.grad(loss_of(twin, batch(step, hvd.rank(), i)), list(twin.parameters()))
        for (name, _), g in zip(twin.named_parameters(), grads, strict=True):
            total[name] += g
    return total


def train_and_compare(rec: Recorder, label: str, compression, reference, *, op=hvd.Average, passes=1,
                      process_set=hvd.global_process_set, expected_bytes=None, rtol=1e-6, atol=1e-7,
                      before_step=None, exact=frozenset(), steps=STEPS, gathered=None,
                      dtype=torch.float32) -> torch.nn.Module:
    """Train ``steps`` steps; at each compare every synchronized gradient with
    ``reference(name, local_grad, step)`` (``None``: train only). ``before_step(step)`` runs first (e.g. set_epoch);
    parameters named in ``exact`` must match bit for bit; ``dtype``: the model's. ``expected_bytes(p)``: the bytes
    a rank hands over for ``p`` each step, allreduced unless ``gathered(p)`` (then every other rank receives
    them), from which the link's share ``stats["volume"]`` follows. Returns the trained model."""
    torch.manual_seed(0)
    model = Net().to(dtype)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression,
                                   op=op, backward_passes_per_step=passes, process_set=process_set)
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        opt.zero_grad()
        local = local_gradients(model, step, passes)
        for i in range(passes):
            loss_of(model, batch(step, hvd.rank(), i)).backward()
        opt.synchronize()
        for name, p in model.named_parameters():
            if reference is None:
                break
            expected = reference(name, local[name], step)
            if name in exact:
                rec.equal(p.grad, expected, f"{label}: step {step} {name} (bit-exact)")
            else:
                rec.close(p.grad, expected, f"{label}: step {step} {name}", rtol, atol)
        with opt.skip_synchronize():
            opt.step()
    if expected_bytes is not None:
        dense = sum(p.numel() * 4 for p in model.parameters()) * STEPS
        sent = sum(expected_bytes(p) for p in model.parameters()) * STEPS
        stats = opt.grace.stats  # the bundle that ran it: the one given, or built around a bare compressor
        rec.check(f"{label}: stats bytes_sent", stats["bytes_sent"] == sent, f"{stats['bytes_sent']} != {sent}")
        rec.check(f"{label}: stats bytes_dense", stats["bytes_dense"] == dense, f"{stats['bytes_dense']} != {dense}")
        world = process_set.size()
        ring = 2 * (world - 1) / world  # a ring allreduce's bytes on each link, per byte reduced
        wire = sum((world - 1) * expected_bytes(p) if gathered is not None and gathered(p)
                   else ring * expected_bytes(p) for p in model.parameters())
        volume = wire / (ring * sum(p.numel() * 4 for p in model.parameters()))
        rec.check(f"{label}: stats volume", abs(stats["volume"] - volume) < 1e-12, f"{stats['volume']} != {volume}")
    return model


def mean_over_ranks(transform, process_set=hvd.global_process_set, op=hvd.Average):
    def reference(name, grad, step):
        contributions = gather_from_ranks(transform(name, grad, step), process_set)
        total = mean_of(contributions)
        return total * len(contributions) if op == hvd.Sum else total
    return reference


