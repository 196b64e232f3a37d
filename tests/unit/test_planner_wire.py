"""The planner's link bytes are what a real ``Grace`` bundle records: for every rank of in-process
worlds of 2, 3, 4 and 8 ranks, one step of a model through the bundle (its own route choice, its
fused buckets, its scatter-gather) leaves ``stats["wire_bytes"]``, ``stats["wire_dense"]``,
``stats["bytes_sent"]`` and ``stats["tensors_by_route"]`` equal to the planner's prediction for that
rank, bit for bit, for Top-k, QSGD, SignSGD, EFSignSGD, FP16, PowerSGD and a LEGACY schedule (every
phase), fused and not; and with a route forced as ``Grace(communicator=...)`` forces it."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import FP16, QSGD, Allgather, EFSignSGD, Grace, Legacy, PowerSGD, ScatterGather, SignSGD, TopK
from grace_legacy.communicators.scatter_gather import segments_of
from grace_legacy.planner import plan, segment_runs
from tests.helpers import run_ranks

#: A model's parameters in registration order: matrices and vectors, some smaller than 8 ranks, one
#: large enough that compressed routes beat dense even at 8 ranks.
SHAPES = [("conv1.weight", (8, 3, 3, 3)), ("conv1.bias", (8,)), ("conv2.weight", (16, 8, 3, 3)),
          ("conv2.bias", (16,)), ("odd", (7, 13)), ("tiny", (3,)), ("fc.weight", (300, 50)), ("fc.bias", (300,)),
          ("norm.weight", (10,)), ("norm.bias", (10,))]

SETUPS = {
    "topk": lambda: TopK(0.1),
    "qsgd": lambda: QSGD(127),
    "signsgd": SignSGD,
    "efsignsgd": lambda: EFSignSGD(0.1),
    "fp16": FP16,
    "powersgd": lambda: PowerSGD(2),
    "legacy": lambda: Legacy(TopK(), by="both", values=[[1.0, 0.2], [0.5, 0.02]], splits=[100], epochs=2),
}

#: Each tensor alone; buckets of a few tensors each (some cut across shards); everything in one.
BUCKETS = [0, 4096, None]


def measured(make, world: int, bucket_bytes: int | None, phases: int, communicator=None,
             dense_fallback: bool = True) -> list[list[dict]]:
    """Each rank's stats after one step of each phase (``result[rank][phase]``), the tensors
    started and finished in arrival order (the reverse of registration), as the optimizer does."""
    arrival = list(reversed(SHAPES))
    bundles = [Grace(make(), communicator=communicator, dense_fallback=dense_fallback, bucket_bytes=bucket_bytes)
               for _ in range(world)]
    for bundle in bundles:
        bundle.plan_buckets([(name, torch.Size(shape).numel() * 4) for name, shape in arrival])

    def body(backend):
        bundle = bundles[backend.rank()]
        generator = torch.Generator().manual_seed(backend.rank())
        out = []
        for phase in range(phases):
            bundle.set_epoch(phase)
            bundle.reset_stats()
            pending = [bundle.start(torch.randn(shape, generator=generator), name, backend, average=True)
                       for name, shape in arrival]
            for p in pending:
                p()
            bundle.end_step()
            out.append(bundle.stats)
        return out

    return run_ranks(world, body)


def check(result, stats_per_rank, phases):
    for rank, stats in enumerate(stats_per_rank):
        for phase in range(phases):
            got = stats[phase]
            where = f"rank {rank} phase {phase}"
            assert got["tensors_by_route"] == result.routes(phase), where
            assert got["wire_bytes"] == result.rank_link_bytes(rank, phase), where
            assert got["wire_dense"] == result.rank_link_dense(phase), where
            assert got["bytes_sent"] == result.rank_bytes_sent(rank, phase), where
    # The plan's per-step figure is the mean over the ranks.
    for phase in range(phases):
        mean = sum(stats[phase]["wire_bytes"] for stats in stats_per_rank) / len(stats_per_rank)
        assert result.phase_totals(phase)[0] == pytest.approx(mean, rel=1e-12)


@pytest.mark.parametrize("communicator", [None, "auto"])
@pytest.mark.parametrize("bucket_bytes", BUCKETS)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("label", sorted(SETUPS))
def test_planned_link_bytes_are_the_bundles(label, world, bucket_bytes, communicator):
    make = SETUPS[label]
    result = plan(make(), SHAPES, world_size=world, bucket_bytes=bucket_bytes, route=communicator)
    phases = len(result.phase_weights)
    check(result, measured(make, world, bucket_bytes, phases, communicator), phases)


def test_the_cases_take_every_route():
    """The model and world sizes above exercise every route the bundle chooses, and fused
    scatter-gathers whose tensors are cut into fewer segments than alone."""
    seen = set()
    for make in SETUPS.values():
        for world, route in itertools.product((2, 3, 4, 8), (None, "auto")):
            result = plan(make(), SHAPES, world_size=world, bucket_bytes=4096, route=route)
            for phase in range(len(result.phase_weights)):
                seen.update(result.routes(phase))
            alone = plan(make(), SHAPES, world_size=world, bucket_bytes=0, route=route)
            fused = [t for phase in result.tensors for t in phase if t.route == "scattergather"]
            single = {(t.phase, t.index): t for phase in alone.tensors for t in phase}
            if any(t.segment_count < single[t.phase, t.index].segment_count for t in fused):
                seen.add("fewer segments in a bucket")
    assert seen == {"dense", "dense-fallback", "allreduce", "allgather", "scattergather",
                    "fewer segments in a bucket"}


@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize(("route", "communicator"), [("allgather", Allgather), ("scattergather", ScatterGather)])
@pytest.mark.parametrize("label", ["topk", "qsgd", "signsgd", "legacy"])
def test_a_forced_route_is_planned_as_the_bundle_runs_it(label, route, communicator, world):
    """``plan(route=...)``, what the scaling table and the link times show per route, is
    ``Grace(communicator=...)`` without the dense fallback."""
    make = SETUPS[label]
    result = plan(make(), SHAPES, world_size=world, bucket_bytes=4096, route=route, dense_fallback=False)
    phases = len(result.phase_weights)
    check(result, measured(make, world, 4096, phases, communicator(), dense_fallback=False), phases)


@given(st.lists(st.integers(0, 40), max_size=8), st.integers(1, 70))
@settings(max_examples=400, deadline=None)
def test_segment_runs_are_the_bundles_segments(sizes, world):
    """The planner's closed form, expanded, is the communicator's list of segments."""
    expanded = [(index, owner, size) for index, runs in enumerate(segment_runs(sizes, world))
                for start, stop, size in runs for owner in range(start, stop)]
    assert expanded == [(s.parcel, s.owner, s.stop - s.start) for s in segments_of(sizes, world)]


def test_any_number_of_workers_is_planned_at_once():
    """No list as long as the number of workers: a plan at 2**62 workers is made at once; the
    ranks that own a segment carry fewer bytes."""
    result = plan(TopK(0.5), [10, 3], world_size=2**62, bucket_bytes=0, route="scattergather", dense_fallback=False)
    tensor = result.tensors[0][0]  # the last registered arrives first
    assert tensor.route == "scattergather" and tensor.segment_count == 3
    ranks = [tensor.link_bytes_of(r) for r in range(4)]
    assert ranks[0] == ranks[1] == ranks[2] < ranks[3]
