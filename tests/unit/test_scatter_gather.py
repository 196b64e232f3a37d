"""ScatterGather, the two-phase compressed allreduce, against its independent reference
(``tests/two_phase.py``), bit for bit, with in-process ranks: every compressor whose payload is not
additive (and FP16 forced onto it), fused buckets and single tensors, 1 to 5 ranks (uneven shards,
tensors smaller than the number of ranks, owners with nothing), over steps that carry the workers'
and the owners' error feedback; a skipped step undone; and its link bytes."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import Grace, ScatterGather, TopK
from grace_legacy.communicators.scatter_gather import segments_of, shard_bounds
from tests.helpers import bits, run_ranks
from tests.two_phase import (
    SETUPS,
    SIZES,
    STEPS,
    WITH_OWNER_FEEDBACK,
    TwoPhase,
    gradients,
    pieces,
    reference,
    shards,
)
from tests.unit.test_contract_undo import tensors_of


def library(label: str, world: int, fused: bool, dtype: torch.dtype,
            owner_feedback: bool = True) -> list[list[torch.Tensor]]:
    make, memory = SETUPS[label]
    # Without the dense fallback, so that every tensor takes the scatter-gather, as in the reference.
    bundles = [Grace(make(), memory=memory(), communicator=ScatterGather(owner_feedback=owner_feedback),
                     dense_fallback=False, bucket_bytes=1 << 20 if fused else 0) for _ in range(world)]
    for bundle in bundles:
        bundle.plan_buckets([(name, 4) for name in SIZES])

    def body(backend):
        bundle = bundles[backend.rank()]
        results = []
        for step in range(STEPS):
            mine = gradients(world, step, dtype)[backend.rank()]
            pending = {name: bundle.start(g, name, backend, average=True) for name, g in zip(SIZES, mine, strict=True)}
            results.append([pending[name]() for name in SIZES])
            bundle.end_step()
        return results

    per_rank = run_ranks(world, body)
    for rank in range(1, world):  # every rank decodes the same owners' payloads
        for step in range(STEPS):
            for got, first in zip(per_rank[rank][step], per_rank[0][step], strict=True):
                assert torch.equal(bits(got), bits(first))
    return per_rank[0]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("label", sorted(SETUPS))
def test_matches_the_reference_bit_for_bit_fused(label, world):
    """Fused: the bucket's four tensors cut into ``world`` shards (uneven at 3 and 5)."""
    got, expected = library(label, world, True, torch.float32), reference(label, world, torch.float32)
    for step in range(STEPS):
        for name, g, e in zip(SIZES, got[step], expected[step], strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype, name
            assert torch.equal(bits(g), bits(e)), f"step {step} {name}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("label", WITH_OWNER_FEEDBACK)
def test_without_the_owners_feedback_matches_the_reference_without_it(label, world):
    """``ScatterGather(owner_feedback=False)``: the owners keep no residual; from the second step on
    that is another result than the default's (in at least one tensor)."""
    got = library(label, world, True, torch.float32, owner_feedback=False)
    expected = reference(label, world, torch.float32, owner_feedback=False)
    kept = reference(label, world, torch.float32)
    for step in range(STEPS):
        for name, g, e in zip(SIZES, got[step], expected[step], strict=True):
            assert torch.equal(bits(g), bits(e)), f"step {step} {name}"
    assert any(not torch.equal(bits(g), bits(k)) for g, k in zip(got[-1], kept[-1], strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("label", sorted(SETUPS))
def test_matches_the_reference_in_other_dtypes(label, dtype):
    got, expected = library(label, 3, True, dtype), reference(label, 3, dtype)
    for step in range(STEPS):
        for g, e in zip(got[step], expected[step], strict=True):
            assert g.dtype == dtype and torch.equal(bits(g), bits(e))


@pytest.mark.parametrize("label", ["topk+residual", "qsgd", "signum", "threshold"])
def test_a_tensor_alone_is_its_own_bucket(label):
    """Unfused, each tensor is cut into shards of its own; the reference sees one tensor at a time."""
    world = 3
    got = library(label, world, False, torch.float32)
    make, memory = SETUPS[label]
    compressors = [make() for _ in range(world)]
    for rank, compressor in enumerate(compressors):
        compressor.set_rank(rank)
    memories = [memory() for _ in range(world)]
    references = {name: TwoPhase(compressors, memories, owner_feedback=label in WITH_OWNER_FEEDBACK)
                  for name in SIZES}
    for step in range(STEPS):
        grads = gradients(world, step)
        for i, name in enumerate(SIZES):
            # One reference per tensor, sharing the ranks' compressors and memories; the memories'
            # step ends once per step, after the last tensor.
            expected = references[name].step([name], [[g[i]] for g in grads], average=True, end_step=False)[0]
            assert torch.equal(bits(got[step][i]), bits(expected)), f"step {step} {name}"
        for m in memories:
            m.end_step()


def test_shards_cover_the_bucket_in_order_and_differ_by_at_most_one():
    for total in (0, 1, 5, 17, 1000):
        for world in (1, 2, 3, 7, 64):
            bounds = shard_bounds(total, world)
            assert bounds[0] == 0 and bounds[-1] == total
            sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert [(a, b) for a, b in zip(bounds, bounds[1:], strict=False)] == shards(total, world)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_segments_are_the_reference_pieces(world):
    sizes = [37, 3, 64, 1, 0, 5]
    assert [tuple(s) for s in segments_of(sizes, world)] == pieces(sizes, world)


def test_a_grace_set_to_auto_chooses_by_link_bytes():
    """At 4 ranks a Top-k payload's gather moves (P - 1) = 3 times its size, the scatter-gather
    about 2 (P - 1) / P = 1.5 times: ``communicator="auto"`` takes the scatter-gather; at 2 ranks
    they tie and it keeps the gather (one lossy step fewer). The default keeps the gather, GRACE's
    result, until dense is cheaper."""
    def route(world, communicator):
        bundle = Grace(TopK(0.01), communicator=communicator)
        return bundle.route_of(bundle.compressor, torch.Size([100_000]), torch.float32, world)

    assert route(2, "auto") == "allgather" and route(4, "auto") == "scattergather"
    assert route(1024, "auto") == "scattergather"
    assert route(2, None) == "allgather" and route(4, None) == "allgather" and route(1024, None) == "dense"


def test_wire_bytes_are_what_each_phase_puts_on_the_link():
    """Phase 1 sends every segment owned by another rank; phase 2 receives every other owner's
    payload: with 4 ranks and Top-k 0.25 on one 400-element tensor (100 elements a shard, 25
    entries of 8 bytes each way), each rank's link carries 3 x 200 + 3 x 200 bytes."""
    world = 4
    bundles = [Grace(TopK(0.25), communicator=ScatterGather(), bucket_bytes=0) for _ in range(world)]

    def body(backend):
        bundle = bundles[backend.rank()]
        g = torch.randn(400, generator=torch.Generator().manual_seed(backend.rank()))
        bundle.start(g, "w", backend, average=True)()
        return bundle.stats

    for stats in run_ranks(world, body):
        assert stats["wire_bytes"] == 3 * 200 + 3 * 200
        assert stats["wire_dense"] == 2 * 3 / 4 * 1600
        assert stats["volume"] == pytest.approx(1200 / 2400)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per tensor"])
@pytest.mark.parametrize("label", ["signum", "topk+residual", "adaq+residual"])
def test_an_undone_step_leaves_every_segments_state_as_it_was(label, fused):
    """A skipped step (an inf on one rank) undone by name: the compressor's state kept under the
    tensor's segment names (Signum's momentum), the worker's and the owner's feedback all return to
    what they were, and hold nothing non-finite."""
    world = 3
    make, memory = SETUPS[label]
    bundles = [Grace(make(), memory=memory(), communicator=ScatterGather(), dense_fallback=False,
                     bucket_bytes=1 << 20 if fused else 0) for _ in range(world)]
    for bundle in bundles:
        bundle.plan_buckets([(name, 4) for name in SIZES])

    def state(bundle) -> dict[str, torch.Tensor]:
        parts = {"compressor": bundle.compressor, "memory": bundle.memory, "owner": bundle.owner_memory}
        return {f"{k}.{key}": t for k, obj in parts.items() if obj is not None
                for key, t in tensors_of(obj.state_dict()).items()}

    def body(backend):
        bundle, rank = bundles[backend.rank()], backend.rank()
        for step in range(2):
            mine = gradients(world, step)[rank]
            pending = [bundle.start(g, name, backend, average=True) for name, g in zip(SIZES, mine, strict=True)]
            [finish() for finish in pending]
            bundle.end_step()
        before = {key: t.clone() for key, t in state(bundle).items()}
        poisoned = gradients(world, 2)[rank]
        if rank == 1:
            poisoned[0][3] = float("inf")
        pending = [bundle.start(g, name, backend, average=True) for name, g in zip(SIZES, poisoned, strict=True)]
        [finish() for finish in pending]
        for name in SIZES:
            bundle.guard.undo(name)
        return before, state(bundle)

    for before, after in run_ranks(world, body):
        assert before, "the set-up keeps state"
        assert after.keys() == before.keys()
        for key in before:
            assert torch.equal(bits(after[key]), bits(before[key])), key
            assert bool(torch.isfinite(after[key]).all()), key
