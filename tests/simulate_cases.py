"""What the simulator is held to real launches with (``tests/distributed/test_simulate.py``): every
compressor of :mod:`tests.registry` on every route it can take, a few schedules, a small model,
its batches, and how a run is recorded.

A *run* trains ``Net`` (``tests/distributed/harness.py``: parameters of 1 to 960 elements, a 0-dim
one among them) for :data:`STEPS` steps of SGD, rank ``r`` (within its world) on ``batch(step, r)``;
it records, per step, every synchronized gradient (rank 0's and the others' are the same: checked
elsewhere), and at the end every rank's byte counts and routes, and the parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grace_legacy import Allgather, Broadcast, Grace, Legacy, LGreCo, Residual, ScatterGather, TopK
from tests.registry import ENTRIES

#: SGD steps of every run.
STEPS = 2
LR = 0.05


def _bundle(make: Callable[[], Any], communicator: Any = None) -> Callable[[], Grace]:
    return lambda: Grace(make(), communicator=communicator)


def _routes_of(entry: Any) -> list[tuple[str, Any]]:
    """The communicators ``entry``'s typical compressor can take: the allreduce for an additive
    payload (its default), a gather for one sent in a single round, and the two-phase route for
    one of those that compresses shards of tensors; each with the dense fallback on, so that the
    smallest tensors go dense."""
    compressor = entry.typical()
    routes: list[tuple[str, Any]] = [("allreduce", None)] if compressor.traits.additive else []
    if compressor.traits.rounds == 1:
        routes += [("allgather", Allgather())]
        if compressor.traits.shardable:
            routes += [("two-phase", ScatterGather())]
    return routes


#: The launchers the cases are shared out among (each runs every third case).
LAUNCHERS = ("gloo", "mpi", "torch")


def setups(launcher: str | None = None, world: int | None = None) -> list[tuple[str, Callable[[], Grace]]]:
    """(label, bundle factory) of every case, each factory building new objects; with ``launcher``
    (one of :data:`LAUNCHERS`) its share: every third case of each kind of route, so that each
    launcher runs every kind and the three together run every case; with ``world`` too (``0``: the
    launcher's whole job, ``1``: each half of it) every other case of that share, so that each case
    runs once."""
    kinds = _setups_by_route()
    if launcher is None:
        return [case for cases in kinds.values() for case in cases]
    share = [case for cases in kinds.values() for case in cases[LAUNCHERS.index(launcher)::len(LAUNCHERS)]]
    return share if world is None else share[world::2]


def _setups_by_route() -> dict[str, list[tuple[str, Callable[[], Grace]]]]:
    kinds: dict[str, list[tuple[str, Callable[[], Grace]]]] = {}
    for entry in ENTRIES:
        for route, communicator in _routes_of(entry):
            kinds.setdefault(route, []).append((f"{entry.label} {route}", _bundle(entry.typical, communicator)))
    kinds["schedules"] = [
        # A None value sends the small tensors dense, without a residual left behind.
        ("Legacy(TopK) by layer", lambda: Grace(Legacy(TopK(), by="layer", values=[None, 0.3, 0.05],
                                                       splits=[10, 500]), memory=Residual())),
        # Rank 0 chooses and broadcasts at the end of the step.
        ("LGreCo(TopK)", lambda: Grace(LGreCo(TopK(), [1.0, 0.2, 0.05], reference=0.2, interval=1),
                                       memory=Residual())),
        ("TopK(0.1) via Broadcast", lambda: Grace(TopK(0.1), memory=Residual(), communicator=Broadcast())),
    ]
    return kinds


def record(model: torch.nn.Module, stats: dict[str, Any], grads: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """What one rank's run leaves: each step's gradients, the byte counts and routes, the parameters."""
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "bytes_sent": stats["bytes_sent"], "wire_bytes": stats["wire_bytes"],
            "routes": dict(stats["tensors_by_route"])}
