"""Elastic training with LEGACY Top-k and error feedback kept in ``hvd.elastic.TorchState``.

It takes the command line of Horovod 0.28.1's own elastic test script
(``test/integration/data/elastic_torch_main.py``), so that Horovod's harness
(``test/integration/elastic_common.py``) can run it in place of theirs (commands in
docs/GUARANTEES.md#faults), and it can fail at a random point of a random step for
``test_elastic_faults.py``.

Horovod's options: ``--epochs``, ``--batches-per-epoch``, ``--batches-per-commit``, ``--epoch-wait``;
``--logfile``: rank 0 appends one JSON line per epoch with the keys the harness reads (epoch, batch,
commits, hostname, start_rank, rank, size, rendezvous); ``--discovery-schedule``/``--discovery-wait``:
at the end of an epoch whose hosts the schedule changes, rank 0 waits until the driver has told it
(at most 30 s by default; Horovod's script waits 3 s, which a loaded machine overruns);
``--exit-schedule`` (``{"(epoch, batch)": [start ranks]}``) and ``--exit-mode exception|kill``: those
processes raise, or SIGKILL themselves, at the start of that batch.

Ours: ``--fault SEED`` draws from SEED one process (by start rank), one step, one point of that
step and the way it fails (:func:`draw_fault`); ``--records DIR``: every process appends its events
(``enter``, ``fault``, ``done``) to ``DIR/records-<pid>.jsonl``.

What the harness cannot see is checked here, on every rank at the end of every epoch: all ranks hold
bit-identical parameters, and compression is on (less than dense sent, some layer compressed, once
the rank has sent anything). A
violation raises ``AssertionError``, which Horovod does not recover from, so the job fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import grace_legacy  # noqa: F401  (hvd.DistributedOptimizer and TorchState accept our compression)
from grace_legacy import Grace, Legacy, Residual, TopK
from tests.faults import FaultInjector

#: Where a drawn fault strikes, in the order a step reaches them: the start of the step; a
#: parameter's gradient hook in the backward pass (later layers' buckets on their way); the n-th
#: compress call or memory update; just before the n-th collective launch, or just after it (the
#: collective in flight); before the n-th wait; after ``optimizer.step()``; inside
#: ``state.commit()``, after this rank saved and before the commit's broadcast.
POINTS = ("start", "backward", "compress", "update", "launch", "launched", "wait", "step", "commit")
GLOBAL_BATCH = 48


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches-per-epoch", type=int, default=10)
    parser.add_argument("--batches-per-commit", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--epoch-wait", type=float, default=0.0)
    parser.add_argument("--logfile", type=Path)
    parser.add_argument("--discovery-schedule", default="[]")
    # Horovod's script waits at most 3 s; on a loaded machine the driver takes longer to tell.
    parser.add_argument("--discovery-wait", type=int, default=30)
    parser.add_argument("--exit-schedule", default="{}")
    parser.add_argument("--exit-mode", choices=["exception", "kill"], default="exception")
    parser.add_argument("--fault", type=int, help="seed of one random fault (draw_fault)")
    parser.add_argument("--processes", type=int, default=3, help="processes of the first world (for --fault)")
    parser.add_argument("--records", type=Path)
    return parser.parse_args()


def draw_fault(seed: int, processes: int, steps: int) -> dict:
    """The fault SEED stands for: which start rank fails, at which global step (never the first,
    whose points the victim counts), where in the step (a point of :data:`POINTS` and ``u`` in
    [0, 1) picking which of that point's occurrences), and how (``kill``: SIGKILL; ``raise``: a
    ``RuntimeError``, which Horovod does not recover from, so the process exits)."""
    rng = random.Random(seed)
    return {"seed": seed, "victim": rng.randrange(processes), "step": rng.randrange(1, steps),
            "point": rng.choice(POINTS), "u": rng.random(), "mode": rng.choice(["kill", "raise"])}


ARGS = parse_args()
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
START_RANK = int(os.environ.get("HOROVOD_RANK", "0"))
STEPS = ARGS.epochs * ARGS.batches_per_epoch
FAULT = None if ARGS.fault is None else draw_fault(ARGS.fault, ARGS.processes, STEPS)


def record(event: str, **fields) -> None:
    if ARGS.records is None:
        return
    line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), "host": HOST,
                       "start_rank": START_RANK, **fields})
    with (ARGS.records / f"records-{os.getpid()}.jsonl").open("a") as f:
        f.write(line + "\n")


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global step ``step``'s batch: the same samples whatever the size."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
    return x[rank::size], y[rank::size]


hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
# The two larger weights (1,024 and 4,096 elements) at 5% density, the rest dense; buckets of
# 4 KiB, so the layers fly in separate buckets.
compression = Grace(Legacy(TopK(), by="layer", values=[1.0, 0.05], splits=[1000]), memory=Residual(),
                    bucket_bytes=4096)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters(), compression=compression)
state = hvd.elastic.TorchState(model, optimizer, compression=compression, epoch=0, batch=0, commits=0,
                               rendezvous=0)

victim = FAULT is not None and FAULT["victim"] == START_RANK


def fail(where: str) -> BaseException:
    """Record the fault, then SIGKILL this process or hand back the exception to raise."""
    route = injector.route if injector is not None and FAULT["point"] in ("launch", "launched", "wait") else None
    record("fault", where=where, route=route, step=state.epoch * ARGS.batches_per_epoch + state.batch, fault=FAULT)
    print(f"elastic_faults_worker: start rank {START_RANK} ({HOST}) fails at {where}: {FAULT}", flush=True)
    if FAULT["mode"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return RuntimeError(f"elastic_faults_worker: planned fault at {where}: {FAULT}")


class Injector(FaultInjector):
    """tests/faults.py's injector, failing as :func:`fail` does, with a point just after each
    launch as well, and knowing which collective (``route``) a launch or wait point is in."""

    def __init__(self, backend) -> None:
        super().__init__(backend, fail)
        self.route: str | None = None
        self.last_counts: dict[str, int] = {}
        self._routes: dict[int, str] = {}

    def allreduce_async(self, tensor, name, average):
        self.route = "allreduce"
        return self._after(super().allreduce_async(tensor, name, average))

    def allgather_async(self, tensor, name):
        self.route = "allgather"
        return self._after(super().allgather_async(tensor, name))

    def broadcast_async(self, tensor, root_rank, name):
        self.route = "broadcast"
        return self._after(super().broadcast_async(tensor, root_rank, name))

    def alltoall_async(self, tensor, splits, name):
        self.route = "alltoall"
        return self._after(super().alltoall_async(tensor, splits, name))

    def wait(self, handle):
        self.route = self._routes.get(id(handle))
        return super().wait(handle)

    def _after(self, handle):
        self._routes[id(handle)] = self.route
        self.point("launched")
        return handle


armed = {"backward": False, "commit": False}
injector = None


def fail_in_backward(grad: torch.Tensor) -> torch.Tensor:
    if armed["backward"]:
        raise fail("backward")
    return grad


if victim:
    injector = optimizer._grace_backend = Injector(optimizer._grace_backend)
    parts = ([compression.compressor.base], [compression.memory])
    if FAULT["point"] == "backward":
        params = list(model.parameters())
        params[int(FAULT["u"] * len(params))].register_hook(fail_in_backward)
    if FAULT["point"] == "commit":
        save = state.save

        def save_then_fail() -> None:
            save()
            if armed["commit"]:
                armed["commit"] = False
                raise fail("commit")

        state.save = save_then_fail


def check_exit(epoch: int, batch_index: int) -> None:
    """Horovod's exit schedule: the listed start ranks fail at the start of this batch."""
    if START_RANK in json.loads(ARGS.exit_schedule).get(str((epoch, batch_index)), []):
        if ARGS.exit_mode == "exception":
            raise RuntimeError(f"exit schedule: epoch={epoch} batch={batch_index} start_rank={START_RANK}")
        os.kill(os.getpid(), signal.SIGKILL)


def train_step(step: int) -> None:
    x, y = batch(step, hvd.rank(), hvd.size())
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def faulty_step(step: int) -> None:
    """One step; on the victim, count its points the step before the fault, then fail at the drawn one."""
    if injector is None or step not in (FAULT["step"] - 1, FAULT["step"]):
        return train_step(step)
    point = FAULT["point"]
    if step == FAULT["step"] - 1:
        injector.count_from_now()
    else:
        if point == "start":
            raise fail("start")
        if point in ("compress", "update", "launch", "launched", "wait"):
            injector.armed = (point, int(FAULT["u"] * injector.last_counts[point]))
            injector.counts.clear()
        armed["backward"] = point == "backward"
    with injector.watching(*parts):
        train_step(step)
    if step == FAULT["step"] - 1:
        injector.last_counts = dict(injector.counts)
    elif point == "step":
        raise fail("step")
    elif point == "commit":
        armed["commit"] = True  # the next commit, at or after this step


def check_epoch() -> None:
    """Every rank holds the same parameters, and compression is on."""
    digests = hvd.allgather_object(digest(model), name="elastic_faults_worker.digest")
    if len(set(digests)) != 1:
        raise AssertionError(f"ranks' parameters differ at epoch {state.epoch}: {digests}")
    # Byte counts are this process's own: a newcomer that joined at an epoch's last commit has none yet.
    stats = compression.stats
    compressed = set(stats["tensors_by_route"]) - {"dense", "dense-fallback"}
    if stats["tensors"] and not (stats["volume"] < 1 and compressed):
        raise AssertionError(f"compression off at epoch {state.epoch}: {stats}")


def log_state() -> None:
    with ARGS.logfile.open("a") as f:
        f.write(json.dumps({"epoch": state.epoch, "batch": state.batch, "commits": state.commits, "hostname": HOST,
                            "start_rank": START_RANK, "rank": hvd.rank(), "size": hvd.size(),
                            "rendezvous": state.rendezvous, "digest": digest(model),
                            "volume": compression.stats["volume"]}) + "\n")


def wait_for_host_change() -> None:
    """As Horovod's script: if the discovery schedule changes the hosts after this epoch, wait
    until the driver has told rank 0, so that the next commit raises HostsUpdatedInterrupt."""
    schedule = json.loads(ARGS.discovery_schedule)
    by_epoch = {epoch: hosts for epoch, hosts in schedule if epoch is not None}
    default = schedule[-1][1] if schedule else []
    if ARGS.discovery_wait <= 0 or by_epoch.get(state.epoch, default) == by_epoch.get(state.epoch + 1, default):
        return
    state._last_updated_timestamp = 0
    start = time.time()
    while state._host_messages.empty():
        if time.time() - start > ARGS.discovery_wait:
            raise TimeoutError("timed out waiting for the driver's host notification")
        time.sleep(0.1)


@hvd.elastic.run
def train(state) -> None:
    state.rendezvous += 1
    record("enter", rank=hvd.rank(), size=hvd.size(), step=state.epoch * ARGS.batches_per_epoch + state.batch)
    while state.epoch < ARGS.epochs:
        compression.set_epoch(state.epoch)
        while state.batch < ARGS.batches_per_epoch:
            check_exit(state.epoch, state.batch)
            faulty_step(state.epoch * ARGS.batches_per_epoch + state.batch)
            state.batch += 1
            if state.batch % ARGS.batches_per_commit == 0:
                state.commits += 1
                state.commit()
        check_epoch()
        if hvd.rank() == 0:
            if ARGS.logfile is not None:
                log_state()
            wait_for_host_change()
        if ARGS.epoch_wait > 0:
            time.sleep(ARGS.epoch_wait)
        state.epoch, state.batch = state.epoch + 1, 0
        state.commits += 1
        state.commit()


if hvd.rank() == 0 and FAULT is not None:
    print(f"elastic_faults_worker: fault {json.dumps(FAULT)}", flush=True)
train(state)
record("done", rank=hvd.rank(), size=hvd.size(), step=state.epoch * ARGS.batches_per_epoch + state.batch,
       digest=digest(model), volume=compression.stats["volume"], routes=compression.stats["tensors_by_route"])
