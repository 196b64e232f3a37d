"""Broadcast: P broadcasts give what one allgather gives, for payloads of any (even zero) size."""

import dataclasses

import pytest
import torch

from grace_legacy import DGC, FP16, Broadcast, Grace, NoCompression, Parcel, RandomK, Residual, Threshold, TopK
from grace_legacy.communicators import Allgather
from grace_legacy.runtime import wire
from tests.helpers import run_ranks

SHAPES = {"conv": (4, 2, 3), "fc": (40, 24), "bias": (5,), "scale": (), "shift": (1,)}


def local_gradient(rank: int, step: int, name: str, shape) -> torch.Tensor:
    seed = 1000 * step + 17 * rank + sorted(SHAPES).index(name)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def train(backend, make_compressor, communicator, steps: int = 3, average: bool = True):
    """Every step: start every tensor, then collect them, as hvd.DistributedOptimizer does."""
    # The fallback would send the tiny tensors dense on both routes; compare the routes themselves.
    bundle = Grace(make_compressor(), memory=Residual(), communicator=communicator, dense_fallback=False)
    results = []
    for step in range(steps):
        pending = {name: bundle.start(local_gradient(backend.rank(), step, name, shape), name, backend, average)
                   for name, shape in SHAPES.items()}
        results.append({name: p() for name, p in pending.items()})
    return results, bundle.stats, list(backend.calls)


@pytest.mark.parametrize("make_compressor", [
    lambda: Threshold(1.5), lambda: Threshold(3.0), lambda: TopK(0.1), lambda: DGC(0.1, min_samples=16),
    lambda: RandomK(0.25, seed=3), FP16,
], ids=["threshold", "threshold-mostly-empty", "topk", "dgc", "randomk", "fp16"])
@pytest.mark.parametrize("average", [True, False])
def test_broadcast_gives_what_allgather_gives_and_sends_the_same_bytes(make_compressor, average):
    by_broadcast = run_ranks(4, lambda b: train(b, make_compressor, Broadcast(), average=average))
    by_allgather = run_ranks(4, lambda b: train(b, make_compressor, Allgather(), average=average))
    for rank in range(4):
        (got, stats, calls), (want, want_stats, _) = by_broadcast[rank], by_allgather[rank]
        for step in range(3):
            for name in SHAPES:
                assert got[step][name].shape == SHAPES[name]
                assert torch.equal(got[step][name], want[step][name]), (rank, step, name)
                assert torch.equal(got[step][name], by_broadcast[0][0][step][name]), "every rank gets the same"
        assert stats["bytes_sent"] == want_stats["bytes_sent"]
        assert stats["tensors_by_route"] == {"broadcast": 3 * len(SHAPES)}
        # bytes_sent is what the rank handed to the backend as a sender (a root, or a gatherer).
        assert stats["bytes_sent"] == sum(nbytes for _, nbytes in calls)


def test_threshold_through_broadcast_matches_an_independent_reference_with_empty_payloads():
    threshold = 2.0

    def first_step(backend):
        bundle = Grace(Threshold(threshold), memory=Residual(), communicator=Broadcast())
        grads = {name: local_gradient(backend.rank(), 0, name, shape) for name, shape in SHAPES.items()}
        pending = {name: bundle.start(g, name, backend, True) for name, g in grads.items()}
        return {name: p() for name, p in pending.items()}, list(backend.calls)

    results = run_ranks(4, first_step)
    empty_somewhere = 0
    for name, shape in SHAPES.items():
        grads = [local_gradient(r, 0, name, shape) for r in range(4)]
        kept = [torch.where(g.abs() >= threshold, g, torch.zeros_like(g)) for g in grads]
        empty = [torch.count_nonzero(k) == 0 for k in kept]
        empty_somewhere += any(empty)
        expected = (kept[0] + kept[1] + kept[2] + kept[3]) / 4
        for got, _ in results:
            torch.testing.assert_close(got[name], expected, rtol=0, atol=0)
    assert empty_somewhere >= 2, "the scenario must have ranks that send nothing"
    # An empty body is not broadcast at all: only roots with something to say are roots.
    calls = results[0][1]
    bodies = [nbytes for kind, nbytes in calls if kind == "broadcast" and nbytes]
    assert len(bodies) < len(SHAPES)
    assert sum(1 for kind, _ in calls if kind == "allgather") == len(SHAPES)


def test_a_uniform_payload_needs_no_header_exchange():
    _, _, calls = run_ranks(3, lambda b: train(b, lambda: TopK(0.1), Broadcast(), steps=1))[1]
    assert {kind for kind, _ in calls} == {"broadcast"}
    assert len(calls) == 3 * len(SHAPES)
    payload, _ = TopK(0.1).compress(torch.randn(40, 24), "fc")
    roots = [nbytes for kind, nbytes in calls if nbytes]
    assert wire.packed_size(payload, with_header=False) in roots


class TwoRounds(NoCompression):
    traits = dataclasses.replace(NoCompression.traits, rounds=2)

    def next_round(self, reduced, ctx):  # pragma: no cover - refused before any round
        raise AssertionError("never reached")


def test_broadcast_refuses_multi_round_compressors():
    with pytest.raises(ValueError, match=r"Broadcast cannot run TwoRounds\(\): it needs 2 allreduce rounds"):
        Broadcast().start(Parcel("w", [torch.ones(2)], None, TwoRounds(), Broadcast()), backend=None, average=True)


def test_broadcast_is_exported_and_carries_anything():
    import grace_legacy

    assert "Broadcast" in grace_legacy.__all__ and Broadcast.route == "broadcast"
    assert Broadcast.carries_non_additive
    Grace(TopK(0.1), communicator=Broadcast())
