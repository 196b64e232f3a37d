"""The optimizer behaviours Horovod's own test suite checks, run with grace_legacy compression and
with Horovod's ``Compression.none`` side by side (so every expectation is first shown to hold for
Horovod itself), under real horovodrun.

Per compression:

* ``synchronize()`` then ``step()`` outside ``skip_synchronize()``: Horovod's warning, and the
  second synchronization leaves the gradients, the byte counts and the compression state (and so
  every later step) exactly as a run with ``skip_synchronize()``;
* ``load_state_dict`` between ``backward()`` and ``step()`` drops that step: the run then goes on
  bit for bit as a run in which the dropped backward pass never happened, and reuses its
  collective names without a clash (grace_legacy compression only: Horovod's own optimizer can
  clash there, see ``load_state_mid_step``);
* ``zero_grad()`` between ``backward()`` and ``step()`` raises Horovod's error and the step can
  still be taken;
* more backward passes than ``backward_passes_per_step`` raise Horovod's error;
* a branch used on one rank only (every rank takes part in every gradient), for several
  optimizers;
* ``requires_grad`` switched between two optimizers' models step by step (a GAN's pattern);
* ``named_parameters`` left out;
* ``broadcast_optimizer_state`` after training, into fresh optimizers of which only rank 0 loaded
  the checkpoint.

After each, every rank's parameters must be bit-identical.
"""

from __future__ import annotations

import copy
import hashlib
import warnings

import horovod.torch as hvd
import torch

import grace_legacy  # noqa: F401  (installs the Horovod integration)
from grace_legacy import Grace, Legacy, PowerSGD, Residual, TopK
from tests.distributed.checks import Recorder, parse_args
from tests.distributed.harness import Net, batch, loss_of

COMPRESSIONS = {
    "hvd.Compression.none": lambda: hvd.Compression.none,
    "TopK(0.1)+Residual": lambda: Grace(TopK(0.1), memory=Residual()),
    "PowerSGD(1)": lambda: Grace(PowerSGD(1)),
    "Legacy(TopK) by step": lambda: Grace(Legacy(TopK(), by="both", values=[[1.0, 0.2], [0.5, 0.05]],
                                                 splits=[100], epochs=2, steps_per_epoch=2), memory=Residual()),
}


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def identical_everywhere(rec: Recorder, label: str, model: torch.nn.Module) -> None:
    digests = hvd.allgather_object(digest(model))
    rec.check(f"{label}: parameters bit-identical on every rank", len(set(digests)) == 1, str(digests))


def build(make_compression, seed: int = 0, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
          **kwargs):
    torch.manual_seed(seed)
    model = Net()
    compression = make_compression()
    opt = hvd.DistributedOptimizer(optimizer(model.parameters()), named_parameters=model.named_parameters(),
                                   compression=compression, **kwargs)
    return model, opt, compression


def backward(model: Net, step: int) -> None:
    loss_of(model, batch(step, hvd.rank())).backward()


def plain(state, leave_out: frozenset = frozenset()):
    """A saved compression state as plain data, without the entries named in ``leave_out``."""
    if isinstance(state, dict):
        return {k: plain(v, leave_out) for k, v in state.items() if k not in leave_out}
    if isinstance(state, (list, tuple)):
        return [plain(v, leave_out) for v in state]
    return state.tolist() if torch.is_tensor(state) else state


def state_of(opt, compression, leave_out: frozenset = frozenset()) -> str:
    """A digest of the optimizer's state and of the compression's (without ``leave_out``)."""
    h = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in opt.state_dict()["param_groups"][0].items())).encode())
    for value in opt.state_dict()["state"].values():
        for item in value.values():
            h.update(item.detach().contiguous().numpy().tobytes() if torch.is_tensor(item) else repr(item).encode())
    if isinstance(compression, Grace):
        h.update(repr(plain(compression.state_dict(), leave_out)).encode())
    return h.hexdigest()


def synchronize_then_step(rec: Recorder, label: str, make) -> None:
    """Horovod warns and synchronizes again; here the second one must change nothing."""
    runs = {}
    for way in ("skip_synchronize", "step after synchronize"):
        model, opt, compression = build(make)
        warned = []
        for step in range(3):
            opt.zero_grad()
            backward(model, step)
            opt.synchronize()
            before = [p.grad.clone() for p in model.parameters()]
            if way == "skip_synchronize":
                with opt.skip_synchronize():
                    opt.step()
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()
                warned.append(any("skip_synchronize" in str(w.message) for w in caught))
                rec.check(f"{label}: step {step}: gradients unchanged by the second synchronize",
                          all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters(), strict=True)))
        if way != "skip_synchronize":
            rec.check(f"{label}: Horovod's warning at every step", all(warned), str(warned))
        stats = dict(compression.stats) if isinstance(compression, Grace) else {}
        runs[way] = (digest(model), state_of(opt, compression), stats)
        identical_everywhere(rec, f"{label}/{way}", model)
    a, b = runs.values()
    rec.check(f"{label}: the same parameters as with skip_synchronize", a[0] == b[0])
    rec.check(f"{label}: the same optimizer and compression state as with skip_synchronize", a[1] == b[1])
    rec.check(f"{label}: the same bytes counted as with skip_synchronize", a[2] == b[2], f"{a[2]} vs {b[2]}")


def load_state_mid_step(rec: Recorder, label: str, make) -> None:
    """The dropped backward pass leaves no trace: the same parameters and state as a run without
    it, but for the byte counts (its collectives did run) and the per-tensor step counters (its
    random draws were taken)."""
    if make is COMPRESSIONS["hvd.Compression.none"]:
        # Horovod's own optimizer drops the handles without waiting, and its next step's allreduce
        # can meet the dropped one, still in flight under the same name: "a tensor with the same
        # name as another tensor that is currently being processed".
        return
    runs = {}
    for way in ("plain", "with a dropped step"):
        model, opt, compression = build(make)
        for step in range(4):
            if way != "plain" and step == 2:
                saved = copy.deepcopy(opt.state_dict())
                opt.zero_grad()
                backward(model, 99)
                opt.load_state_dict(saved)
            opt.zero_grad()
            backward(model, step)
            opt.step()
        runs[way] = (digest(model), state_of(opt, compression, frozenset({"traffic", "steps"})))
        identical_everywhere(rec, f"{label}/{way}", model)
    a, b = runs.values()
    rec.check(f"{label}: the same parameters as without the dropped step", a[0] == b[0])
    rec.check(f"{label}: the same optimizer and compression state as without the dropped step", a[1] == b[1])


def zero_grad_with_pending(rec: Recorder, label: str, make) -> None:
    model, opt, _ = build(make)
    opt.zero_grad()
    backward(model, 0)
    try:
        opt.zero_grad()
    except AssertionError as err:
        rec.check(f"{label}: zero_grad after backward raises Horovod's error", "zero_grad()" in str(err), str(err))
    else:
        rec.check(f"{label}: zero_grad after backward raises Horovod's error", False, "no AssertionError")
    opt.step()
    opt.zero_grad()
    backward(model, 1)
    opt.step()
    identical_everywhere(rec, label, model)


def too_many_backward_passes(rec: Recorder, label: str, make) -> None:
    model, opt, _ = build(make, backward_passes_per_step=2)
    opt.zero_grad()
    backward(model, 0)
    backward(model, 1)
    try:
        backward(model, 2)
    except AssertionError as err:
        rec.check(f"{label}: a third pass raises Horovod's error", "backward_passes_per_step" in str(err), str(err))
    else:
        rec.check(f"{label}: a third pass raises Horovod's error", False, "no AssertionError")


class TwoHeads(torch.nn.Module):
    """Rank 0 trains on the first head, the others on the second: the third layer is unused on
    rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(12, 10), torch.nn.Linear(10, 6), torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.fc2(torch.relu(self.fc1(x)))
        return h if hvd.rank() == 0 else self.fc3(torch.relu(h))


def branch_on_one_rank(rec: Recorder, label: str, make) -> None:
    for name, optimizer in [("SGD", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                            ("Adam", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
                            ("RMSprop", lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True))]:
        torch.manual_seed(0)
        model = TwoHeads()
        opt = hvd.DistributedOptimizer(optimizer(model.parameters()), named_parameters=model.named_parameters(),
                                       compression=make())
        for step in range(2):
            g = torch.Generator().manual_seed(step * 10 + hvd.rank())
            opt.zero_grad()
            model(torch.randn(8, 12, generator=g)).square().sum().backward()
            opt.step()
        identical_everywhere(rec, f"{label}/{name}", model)


def toggled_requires_grad(rec: Recorder, label: str, make) -> None:
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(6, 8), torch.nn.Linear(8, 1)
    gen_opt = hvd.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1),
                                       named_parameters=[(f"gen.{n}", p) for n, p in gen.named_parameters()],
                                       compression=make())
    disc_opt = hvd.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                        named_parameters=[(f"disc.{n}", p) for n, p in disc.named_parameters()],
                                        compression=make())
    ok = True
    for step in range(6):
        train_gen = step % 2 == 0
        for p in gen.parameters():
            p.requires_grad_(train_gen)
        for p in disc.parameters():
            p.requires_grad_(not train_gen)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + hvd.rank()))
        disc(gen(x)).sum().backward()
        ok &= all((p.grad is not None) == train_gen for p in gen.parameters())
        ok &= all((p.grad is not None) != train_gen for p in disc.parameters())
        (gen_opt if train_gen else disc_opt).step()
    rec.check(f"{label}: only the trained model has gradients", ok)
    identical_everywhere(rec, f"{label}/generator", gen)
    identical_everywhere(rec, f"{label}/discriminator", disc)


def no_named_parameters(rec: Recorder, label: str, make) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compression=make())
    for step in range(2):
        opt.zero_grad()
        backward(model, step)
        opt.step()
    identical_everywhere(rec, label, model)


def broadcast_state_after_training(rec: Recorder, label: str, make) -> None:
    model, opt, _ = build(make, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    opt.zero_grad()
    backward(model, 0)
    opt.step()
    checkpoint = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}
    fresh, fresh_opt, _ = build(make, seed=1 + hvd.rank(), optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    if hvd.rank() == 0:
        fresh.load_state_dict(checkpoint["model"])
        fresh_opt.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(fresh.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(fresh_opt, root_rank=0)
    states = hvd.allgather_object(state_of(fresh_opt, None))
    rec.check(f"{label}: every rank holds rank 0's optimizer state", len(set(states)) == 1, str(states))
    fresh_opt.zero_grad()
    backward(fresh, 1)
    fresh_opt.step()
    identical_everywhere(rec, label, fresh)


BEHAVIOURS = {
    "synchronize then step": synchronize_then_step,
    "load_state_dict mid-step": load_state_mid_step,
    "zero_grad with pending gradients": zero_grad_with_pending,
    "too many backward passes": too_many_backward_passes,
    "branch on one rank": branch_on_one_rank,
    "requires_grad toggled": toggled_requires_grad,
    "no named_parameters": no_named_parameters,
    "broadcast_optimizer_state after training": broadcast_state_after_training,
}


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    for behaviour, run in BEHAVIOURS.items():
        for compression, make in COMPRESSIONS.items():
            label = f"{behaviour}/{compression}"
            rec.guard(label, run, rec, label, make)
    rec.write()


if __name__ == "__main__":
    main()
