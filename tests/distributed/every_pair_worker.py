"""For every compressor/memory pair of the registry (``tests.registry.every_pair``), in one
launch: training under ``torch.amp.GradScaler`` (CPU) with an inf injected into one rank's
gradient at one step and a NaN into another rank's at a later step.

For each set-up, checks that:

* the poisoned tensor's synchronized gradient is non-finite on *every* rank (a sparsifier or a
  sign would otherwise have dropped it);
* GradScaler skips exactly the steps it skips without compression (``hvd.Compression.none``,
  trained first): same scale after every step, parameters untouched by a skipped step;
* after a skipped step the compression state holds nothing non-finite, and the memory is what it
  was before the step;
* after training, every rank's parameters are bit-identical (a SHA-256 of their bytes, compared
  across ranks), finite, and moved from where they started.
"""

from __future__ import annotations

import hashlib
import math
import time

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression

from tests.distributed.checks import Recorder, parse_args
from tests.distributed.harness import Net, batch, loss_of
from tests.registry import LR, every_pair

STEPS = 5
#: Small enough that no compressor (FP16: 65504) overflows a scaled gradient of this model.
INIT_SCALE = 2.0**8


def poisons(size: int) -> dict[int, tuple[int, str, tuple[int, int], float]]:
    """step -> (rank, parameter, element, value): an inf on rank 1, later a NaN on the last rank."""
    return {1: (1 % size, "fc1.weight", (0, 0), math.inf), 3: (size - 1, "fc1.weight", (7, 11), math.nan)}


def tensors_in(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by path."""
    out = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list | tuple) else ()
    for key, value in items:
        if isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
        else:
            out.update(tensors_in(value, f"{prefix}{key}."))
    return out


def parameter_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(rec: Recorder, label: str, compression, reference_scales: list[float] | None) -> list[float]:
    rank, size = hvd.rank(), hvd.size()
    planned = poisons(size)
    torch.manual_seed(0)
    model = Net()
    initial = parameter_digest(model)
    params = dict(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), compression=compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    now = {"step": -1}

    def poison(name):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            plan = planned.get(now["step"])
            if plan is None or plan[0] != rank or plan[1] != name:
                return grad
            grad = grad.clone()
            grad[plan[2]] = plan[3]
            return grad
        return hook

    for name in {plan[1] for plan in planned.values()}:
        params[name].register_hook(poison(name))

    grace = compression if hasattr(compression, "state_dict") else None
    scales = []
    for step in range(STEPS):
        now["step"] = step
        opt.zero_grad()
        before = {n: p.detach().clone() for n, p in params.items()}
        memory_before = tensors_in(grace.state_dict()["memory"]) if grace is not None else {}
        scaler.scale(loss_of(model, batch(step, rank))).backward()
        opt.synchronize()
        if step in planned:
            grad = params[planned[step][1]].grad
            rec.check(f"{label}: step {step}: the poisoned gradient is non-finite on this rank",
                      not bool(torch.isfinite(grad).all()))
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if step in planned:
            unchanged = [n for n, p in params.items() if not torch.equal(p.detach(), before[n])]
            rec.check(f"{label}: step {step}: skipped, parameters untouched", not unchanged, f"changed: {unchanged}")
        if step in planned and grace is not None:
            state = tensors_in(grace.state_dict())
            bad = [path for path, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
            rec.check(f"{label}: step {step}: no non-finite compression state after the skipped step", not bad,
                      f"non-finite: {bad}")
            memory_after = tensors_in(grace.state_dict()["memory"])
            same = memory_after.keys() == memory_before.keys() and all(
                torch.equal(memory_after[k], memory_before[k]) for k in memory_before)
            rec.check(f"{label}: step {step}: the memory is as before the skipped step", same,
                      f"before {sorted(memory_before)}, after {sorted(memory_after)}")
    if reference_scales is not None:
        rec.check(f"{label}: GradScaler skips the same steps as without compression", scales == reference_scales,
                  f"scales {scales}, without compression {reference_scales}")
    digest = parameter_digest(model)
    digests = hvd.allgather_object(digest, name=f"digest.{label}")
    rec.check(f"{label}: parameters bit-identical on every rank", len(set(digests)) == 1, f"digests {digests}")
    rec.check(f"{label}: parameters finite and trained",
              all(bool(torch.isfinite(p).all()) for p in model.parameters()) and digest != initial)
    return scales


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    rec = Recorder(args.out)
    started = time.perf_counter()
    reference = rec.guard("hvd.Compression.none", train, rec, "hvd.Compression.none", Compression.none, None)
    rec.extra["reference_seconds"] = round(time.perf_counter() - started, 3)
    expected_skips = [INIT_SCALE * 0.5 ** sum(s <= step for s in poisons(hvd.size())) for step in range(STEPS)]
    rec.check("hvd.Compression.none: skips exactly the poisoned steps", reference == expected_skips,
              f"scales {reference}, expected {expected_skips}")
    seconds = {}
    for label, build in every_pair():
        started = time.perf_counter()
        rec.guard(label, train, rec, label, build(), reference)
        seconds[label] = round(time.perf_counter() - started, 3)
    rec.extra["setups"] = seconds
    rec.write()


if __name__ == "__main__":
    main()
