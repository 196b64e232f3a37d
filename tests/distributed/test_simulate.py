"""The simulator against real ranks: every case of :mod:`tests.simulate_cases` (every compressor of
the registry on every route it can take, and a few schedules) run by real ``horovodrun`` (Gloo and
MPI) and ``torchrun`` jobs of 4 ranks (see :data:`RANKS`), half of the cases on all of them and the
other half on each half of them (worlds of 4 and 2), then by
:class:`grace_legacy.simulate.Simulation` with as many workers and the launcher's order of addition:
every step's synchronized gradients, the final parameters and every rank's ``bytes_sent``,
``wire_bytes`` and routes must be the same, bit for bit. Held to rounding instead: payloads the
backend adds in float16 (FP16's; BF16's under ``torchrun``, where Gloo adds bfloat16), since the
collective libraries round some 16-bit additions their own way, and, under Horovod's Gloo, tensors
allreduced one by one at the same time (the Broadcast case's dense ones), which Horovod's own tensor
fusion may put in one buffer, whose ring segments depend on what it fused
(:mod:`grace_legacy.simulate.sums`). One launch per launcher, each running a third of the cases
(``simulate_cases.setups``), so each case runs once and each launcher runs every kind of route."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grace_legacy.simulate import Simulation
from tests.distributed.harness import Net, batch
from tests.distributed.launcher import WorkerFailure, horovodrun, torchrun
from tests.helpers import bits
from tests.simulate_cases import LAUNCHERS, LR, STEPS, record, setups

pytestmark = pytest.mark.distributed

#: Ranks of each launcher's job (worlds of that many, and of half as many): 4, the fewest at which
#: the ring, recursive doubling and rank order add in different orders, so the test's time stays in
#: the suite's budget on 2 cores (the orders at 8 ranks: scripts/allreduce_order.py, and the unit
#: tests' algorithms run message by message up to 8).
RANKS = {"gloo": 4, "mpi": 4, "torch": 4}
#: The simulated allreduce's order of addition for each launcher.
REDUCTION = {"gloo": "horovod-gloo", "mpi": "horovod-mpi", "torch": "torch-gloo"}


def within_rounding(label: str, launcher: str) -> bool:
    """Whether this case's sums are held to rounding rather than bits (see the module docstring)."""
    return (label == "FP16 allreduce" or (label == "BF16 allreduce" and launcher == "torch")
            or (label == "TopK(0.1) via Broadcast" and launcher == "gloo"))


def simulate(world: int, make, reduction: str) -> list[dict]:
    """The case trained by ``world`` simulated workers: each worker's record, as a rank's."""
    torch.manual_seed(0)
    model = Net()
    with Simulation(model, lambda worker: make(), world, reduction=reduction, vectorize=False, check=True) as sim:
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        grads = []
        for step in range(STEPS):
            sgd.zero_grad()
            sim.backward([batch(step, rank) for rank in range(world)])
            sgd.step()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        return [record(model, stats, grads) for stats in sim.stats]


def differences(real: dict, simulated: dict, close: bool) -> list[str]:
    """What differs between a real rank's record and its simulated worker's."""
    found = []
    for key in ("bytes_sent", "wire_bytes", "routes"):
        if real[key] != simulated[key]:
            found.append(f"{key} {real[key]!r} != {simulated[key]!r}")
    pairs = [(f"step {step} grad {name}", got, simulated["grads"][step][name])
             for step, grads in enumerate(real["grads"]) for name, got in grads.items()]
    pairs += [(f"parameter {name}", got, simulated["params"][name]) for name, got in real["params"].items()]
    for where, got, expected in pairs:
        if close:
            if not torch.allclose(got, expected, rtol=2e-3, atol=1e-5):
                found.append(f"{where}: max |diff| {(got - expected).abs().max().item():.3e} beyond 16-bit rounding")
        elif got.shape != expected.shape or not torch.equal(bits(got), bits(expected)):
            found.append(f"{where}: max |diff| {(got - expected).abs().max().item():.3e}")
    return found


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_simulator_computes_what_real_ranks_compute(launcher, tmp_path):
    ranks = RANKS[launcher]
    if launcher == "torch":
        result = torchrun("simulate_worker.py", ranks, tmp_path, "--launcher", "torch", timeout=900)
    else:
        result = horovodrun("simulate_worker.py", ranks, launcher, tmp_path, "--launcher", launcher, timeout=900)
    if result.returncode != 0:
        raise WorkerFailure(f"simulate_worker.py exited {result.returncode}\n{result.stdout[-8000:]}")
    runs = [torch.load(Path(tmp_path) / f"rank{rank}.pt") for rank in range(ranks)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: a backward pass's sums may depend on the thread count
    failures = []
    try:
        for index, world in enumerate((ranks, ranks // 2)):
            for label, make in setups(launcher, index):
                workers = simulate(world, make, REDUCTION[launcher])
                for rank in range(ranks):
                    found = differences(runs[rank][(world, label)], workers[rank % world],
                                        within_rounding(label, launcher))
                    failures += [f"{world} ranks, {label}, rank {rank}: {f}" for f in found[:3]]
    finally:
        torch.set_num_threads(threads)
    assert not failures, "\n".join(failures[:40])
    # Every kind of route was taken, so each was compared.
    routes = {route for run in runs[0].values() for route in run["routes"]}
    assert {"allreduce", "allgather", "scattergather", "dense-fallback"} <= routes, routes
