"""Elastic training with LEGACY-scheduled Top-k and error feedback, under elastic ``horovodrun``.

Every process appends one JSON line per event to ``<out>/records-<pid>.jsonl``, so that the test
can follow each process through every world it lived in:

* ``enter``: ``hvd.elastic.run`` (re)started training: the step it continues from, rank, size,
  and the size of this process's error-feedback residuals;
* ``step``: a finished optimizer step, with a digest of the parameters and the bytes sent;
* ``commit``: the step about to be committed, with the residuals' size;
* ``done``: training reached its last step.

``--scenario raise|kill`` makes the process on ``--fail-host`` raise, or SIGKILL itself, in the
middle of step ``--fail-at``'s backward pass (with the bundle's small buckets, some sent and
others not), in its first world only. ``--scenario hosts`` makes rank 0 rewrite ``--hosts-file``
(which the discovery script prints) at the commits named by ``--hosts-at STEP=HOSTS``, and wait
until Horovod's driver has noticed, so that the next commit raises ``HostsUpdatedInterrupt``.
``--bare`` gives the schedule itself as the compression.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer and TorchState accept our compression)
from grace_legacy import Grace, Legacy, Residual, TopK

STEPS_PER_EPOCH = 8
#: How long rank 0 waits for the driver to notice a rewritten hosts file.
HOST_NOTICE_TIMEOUT_S = 180


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenario", choices=["raise", "kill", "hosts"], required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--commit-every", type=int, default=4)
    parser.add_argument("--fail-at", type=int, default=6)
    parser.add_argument("--fail-host", default="localhost")
    parser.add_argument("--hosts-file", type=Path)
    parser.add_argument("--bare", action="store_true", help="give the bare schedule as compression")
    parser.add_argument("--hosts-at", action="append", default=[], help="STEP=HOSTS (hosts ';'-separated)")
    return parser.parse_args()


ARGS = parse_args()
RECORDS = ARGS.out / f"records-{os.getpid()}.jsonl"
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")


def record(event: str, **fields) -> None:
    line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), "host": HOST, "rank": hvd.rank(),
                       "size": hvd.size(),
                       **fields})
    with RECORDS.open("a") as f:
        f.write(line + "\n")


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def residual_norm(compression: Grace) -> float:
    return float(sum(r.double().norm() ** 2 for r in compression.memory.residuals.values()))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch: the same 48 samples whatever the size."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(48, 64, generator=g), torch.randint(0, 10, (48,), generator=g)
    return x[rank::size], y[rank::size]


hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
# Layers under 1,000 elements dense, larger ones at 10% then 5% from epoch 2; buckets small
# enough that the layers fly in separate buckets.
schedule = Legacy(TopK(), by="both", values=[[1.0, 0.1], [1.0, 0.05]], splits=[1000], epochs=4,
                  steps_per_epoch=STEPS_PER_EPOCH)
# --bare: the schedule itself is the compression (the optimizer wraps it in a bundle with Top-k's
# recommended memory, error feedback), and TorchState is given the schedule.
given = schedule if ARGS.bare else Grace(schedule, memory=Residual(), bucket_bytes=8 * 1024)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9),
                                     named_parameters=model.named_parameters(), compression=given)
compression = optimizer.grace
assert isinstance(compression.memory, Residual)
# The failing host has one slot, so exactly one process fails, in the first world (it dies).
failing = {"armed": ARGS.scenario in ("raise", "kill") and HOST == ARGS.fail_host}
hosts_at = {int(step): hosts.replace(";", "\n") for step, hosts in (item.split("=", 1) for item in ARGS.hosts_at)}


def fail_in_backward(grad: torch.Tensor) -> torch.Tensor:
    """Fires while the first layer's gradient is computed: later layers' buckets are on their way."""
    if failing.get("now"):
        if ARGS.scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"elastic_worker: the process on {HOST} fails mid-step as planned")
    return grad


model[0].weight.register_hook(fail_in_backward)


def rewrite_hosts(state, hosts: str) -> None:
    temporary = ARGS.hosts_file.with_suffix(".tmp")
    temporary.write_text(hosts + "\n")
    os.replace(temporary, ARGS.hosts_file)
    # The driver polls the discovery script about once a second, then tells rank 0; only then
    # does a commit raise HostsUpdatedInterrupt on every rank.
    state._last_updated_timestamp = 0
    deadline = time.monotonic() + HOST_NOTICE_TIMEOUT_S
    while state._host_messages.empty():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the driver did not notice hosts {hosts!r} in {HOST_NOTICE_TIMEOUT_S} s")
        time.sleep(0.1)


@hvd.elastic.run
def train(state) -> None:
    record("enter", step=state.step, residual=residual_norm(compression), lr=optimizer.param_groups[0]["lr"])
    while state.step < ARGS.steps:
        failing["now"] = failing["armed"] and state.step + 1 == ARGS.fail_at
        sent, dense = compression.stats["bytes_sent"], compression.stats["bytes_dense"]
        x, y = batch(state.step, hvd.rank(), hvd.size())
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        state.step += 1
        record("step", step=state.step, digest=digest(model), sent=compression.stats["bytes_sent"] - sent,
               dense=compression.stats["bytes_dense"] - dense)
        if state.step % ARGS.commit_every == 0:
            if hvd.rank() == 0 and state.step in hosts_at:
                rewrite_hosts(state, hosts_at.pop(state.step))
            record("commit", step=state.step, residual=residual_norm(compression))
            state.commit()
    record("done", step=state.step, digest=digest(model), volume=compression.stats["volume"])


def rescale_lr() -> None:
    for group in optimizer.param_groups:
        group["lr"] = 0.05 * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, compression=given, step=0)
state.register_reset_callbacks([rescale_lr])
train(state)
