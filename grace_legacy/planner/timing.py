"""The plan over worker counts (:func:`scaling`), and the link time of a plan.

**Link time** (:func:`link_time`), the alpha-beta model of the same algorithms: a collective of
``s`` sequential steps costs ``alpha * s`` and each rank's link carries its link bytes at
``bandwidth``: ``T = alpha * sum(steps) + link bytes / bandwidth``. The steps are those of the
algorithms whose link bytes are counted, so that both terms describe one algorithm: a ring
allreduce ``2 (P - 1)`` (reduce-scatter then allgather, ``P - 1`` each), a ring allgather
``P - 1``, a pairwise all-to-all ``P - 1``. A flight (a fused bucket, or a tensor alone) runs one
allgather for its gathered payloads, one allreduce per dtype and round for its summed ones, and an
all-to-all then an allgather for its scatter-gathered ones; collectives run one after another, and
nothing overlaps the backward pass. At large ``P`` the ring's latency term is pessimistic: libraries
switch to trees or recursive doubling (``log2 P`` steps, more bytes), which this model leaves out.

**Step time** (:func:`step_time`): a measured compute time (forward, backward, the optimizer and
the compressor's own work: a step timed where the link is no limit) followed by the link time, in
that order, as the link model has it. It is a ranking aid, not a promise: where workers share cores,
one worker's link time is another's compute, and how much of it is hidden differs by route.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from grace_legacy.core.compressor import Compressor
from grace_legacy.planner.plan import AUTO, WORKER_COUNTS, Plan, plan


def routes_for(compression: Compressor) -> list[str]:
    """The routes :func:`plan` can force for ``compression`` (besides ``"dense"``): an allreduce
    for an additive payload, a gather and a scatter-gather for a single-round one."""
    out = ["allreduce"] if compression.traits.additive else []
    return out + (["allgather", "scattergather"] if compression.traits.rounds == 1 else [])


@dataclass(frozen=True)
class Scaling:
    """One worker count: the default bundle's plan (``chosen``), the byte-optimal one
    (``Grace(communicator="auto")``'s), and the volume with every compressed tensor on each route
    alone (no dense fallback), per :func:`routes_for` route."""

    world_size: int
    chosen: Plan
    auto: Plan
    forced: dict[str, Plan]


def scaling(compression: Compressor, shapes: Iterable[Any], worker_counts: Iterable[int] = WORKER_COUNTS,
            **options: Any) -> list[Scaling]:
    """:func:`plan` at each of ``worker_counts``: the default bundle's choice, the byte-optimal
    one and each route alone (``options``: ``dtype``, ``bucket_bytes``)."""
    shapes = list(shapes)
    out = []
    for world_size in worker_counts:
        chosen = plan(compression, shapes, world_size=world_size, **options)
        auto = plan(compression, shapes, world_size=world_size, route=AUTO, **options)
        forced = {route: plan(compression, shapes, world_size=world_size, route=route, dense_fallback=False,
                              **options) for route in routes_for(compression)}
        out.append(Scaling(world_size, chosen, auto, forced))
    return out


def collective_steps(kind: str, world_size: int) -> int:
    """Sequential steps of one collective among ``world_size`` ranks: a ring allreduce
    ``2 (P - 1)``, a ring allgather and a pairwise all-to-all ``P - 1``."""
    if world_size < 2:
        return 0
    return (2 if kind == "allreduce" else 1) * (world_size - 1)


@dataclass(frozen=True)
class LinkTime:
    """The alpha-beta estimate of one step's communication (means over the run's phases)."""

    collectives: float
    steps: float
    latency_s: float
    transfer_s: float

    @property
    def total_s(self) -> float:
        return self.latency_s + self.transfer_s


def link_time(result: Plan, bandwidth: float, latency: float) -> LinkTime:
    """``latency * steps + link bytes / bandwidth`` per step (``bandwidth`` in bytes per second of
    each rank's link, ``latency`` in seconds per step of a collective), weighted over the phases."""
    if not (isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"link_time: bandwidth must be a finite number of bytes per second > 0, got {bandwidth!r}")
    if not (isinstance(latency, (int, float)) and math.isfinite(latency) and latency >= 0):
        raise ValueError(f"link_time: latency must be a finite number of seconds >= 0, got {latency!r}")
    collectives = steps = transfer = 0.0
    for phase, weight in enumerate(result.phase_weights):
        counts = result.collectives[phase]
        collectives += weight * sum(counts.values())
        steps += weight * sum(n * collective_steps(kind, result.world_size) for kind, n in counts.items())
        transfer += weight * sum(t.link_bytes for t in result.tensors[phase]) / bandwidth
    return LinkTime(collectives, steps, latency * steps, transfer)


def step_time(result: Plan, bandwidth: float, latency: float, compute: float) -> float:
    """``compute`` seconds then :func:`link_time`'s: the estimated seconds of one training step."""
    if not (isinstance(compute, (int, float)) and math.isfinite(compute) and compute >= 0):
        raise ValueError(f"step_time: compute must be a finite number of seconds >= 0, got {compute!r}")
    return compute + link_time(result, bandwidth, latency).total_s
