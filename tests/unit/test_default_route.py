"""The default route keeps the algorithm the user named: with no communicator, every rank's
payload is combined by the compressor's own rule (GRACE's result) at any number of ranks, never
re-compressed by a two-phase owner; ``communicator="auto"`` is the byte-optimal choice one
argument away, and the default says once, on rank 0, when it costs far more link bytes."""

import logging
import math

import pytest
import torch

from grace_legacy import QSGD, Allgather, EFSignSGD, Grace, Legacy, NoMemory, ScatterGather, SignSGD, TopK
from grace_legacy.runtime.advice import ADVICE_FACTOR
from grace_legacy.runtime.cost import choose_route, link_bytes, route_link_bytes
from tests.helpers import run_ranks

SHAPE = torch.Size([64, 50])


def top_k_by_sorting(tensor: torch.Tensor, ratio: float) -> torch.Tensor:
    """The tensor with all but its ``max(1, floor(ratio * n))`` largest magnitudes zeroed, by a
    stable full sort (ties to the earlier index), written apart from the library's selection."""
    flat = tensor.reshape(-1)
    k = max(1, math.floor(ratio * flat.numel()))
    keep = torch.sort(flat.abs(), descending=True, stable=True).indices[:k]
    out = torch.zeros_like(flat)
    out[keep] = flat[keep]
    return out.view(tensor.shape)


def gradient(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 * step + rank))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_top_k_without_memory_is_grace_s_mean_of_every_rank_s_top_k(world):
    """The issue's case: Grace(TopK(0.1), NoMemory()) gave the two-phase result from three ranks on."""
    def body(backend):
        bundle = Grace(TopK(0.1), memory=NoMemory(), bucket_bytes=0)
        results = [bundle.start(gradient(backend.rank(), step), "w", backend, True)() for step in range(2)]
        return results, bundle.stats["tensors_by_route"]

    for results, routes in run_ranks(world, body):
        assert routes == {"allgather": 2}
        for step, result in enumerate(results):
            expected = sum(top_k_by_sorting(gradient(r, step), 0.1) for r in range(world)) / world
            torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", [lambda: TopK(0.01), lambda: QSGD(16), lambda: EFSignSGD(0.1), lambda: SignSGD(),
                                  lambda: Legacy(TopK(), by="layer", values=[1.0, 0.01], splits=[100])],
                         ids=["topk", "qsgd", "efsignsgd", "signsgd", "legacy"])
@pytest.mark.parametrize("world", [3, 8, 64, 1024])
def test_the_default_never_takes_the_two_phase_route_and_auto_may(make, world):
    compressor = make()
    concrete = compressor.compressor_for(torch.empty(SHAPE), "w")
    default = choose_route(concrete, SHAPE, torch.float32, world)
    assert default in ("dense", "allreduce", "allgather")
    auto = choose_route(concrete, SHAPE, torch.float32, world, byte_optimal=True)
    costs = route_link_bytes(concrete, SHAPE, torch.float32, world, busiest=True)
    assert costs[auto] == min(costs.values())
    assert link_bytes(concrete, SHAPE, torch.float32, world, byte_optimal=True) <= \
        link_bytes(concrete, SHAPE, torch.float32, world) * (1 + 1e-12)


def test_auto_is_one_argument_away_and_scatter_gather_forces_the_two_phase_route():
    def body(backend, communicator):
        bundle = Grace(TopK(0.1), memory=NoMemory(), bucket_bytes=0, communicator=communicator)
        bundle.start(gradient(backend.rank()), "w", backend, True)()
        return bundle.stats["tensors_by_route"]

    assert run_ranks(4, lambda b: body(b, None))[0] == {"allgather": 1}
    assert run_ranks(4, lambda b: body(b, "auto"))[0] == {"scattergather": 1}
    assert run_ranks(4, lambda b: body(b, ScatterGather()))[0] == {"scattergather": 1}
    assert run_ranks(2, lambda b: body(b, "auto"))[0] == {"allgather": 1}  # two ranks: no fewer bytes


def test_auto_is_part_of_the_configuration_and_other_words_are_refused():
    assert Grace(TopK(0.1), communicator="auto").configuration()["communicator"] == "'auto'"
    assert Grace(TopK(0.1)).configuration()["communicator"] == "None"
    assert "communicator='auto'" in repr(Grace(TopK(0.1), communicator="auto"))
    with pytest.raises(ValueError, match="communicator must be .* 'auto'"):
        Grace(TopK(0.1), communicator="fastest")


def run_first_step(world, communicator, caplog, shape=SHAPE, ratio=0.01):
    caplog.clear()

    def body(backend):
        bundle = Grace(TopK(ratio), bucket_bytes=0, communicator=communicator)
        for _ in range(2):
            bundle.start(torch.randn(shape), "w", backend, True)()
            bundle.start(torch.randn(3), "b", backend, True)()
            bundle.end_step(backend)

    with caplog.at_level(logging.WARNING, logger="grace_legacy"):
        run_ranks(world, body)
    return [r.getMessage() for r in caplog.records if r.name == "grace_legacy"]


def test_rank_0_says_once_when_the_default_costs_far_more_than_two_phase(caplog):
    lines = run_first_step(8, None, caplog)
    assert len(lines) == 1  # one line, rank 0 only, the first step only
    concrete = TopK(0.01)
    costs = route_link_bytes(concrete, SHAPE, torch.float32, 8)
    factor = costs["allgather"] / costs["scattergather"]
    assert factor >= ADVICE_FACTOR
    assert f"{factor:.1f}x" in lines[0] and "communicator='auto'" in lines[0] and "8 workers" in lines[0]
    dense_b = 3 * 4 * 2 * 7 / 8
    assert f"{costs['allgather'] / (costs['allgather'] + dense_b):.0%}" in lines[0]


@pytest.mark.parametrize(("world", "communicator"), [(8, "auto"), (8, Allgather()), (2, None), (3, None)])
def test_no_advice_with_a_communicator_named_or_where_the_default_is_close(world, communicator, caplog):
    assert run_first_step(world, communicator, caplog) == []


def test_advice_where_the_default_falls_back_to_dense_but_two_phase_would_compress(caplog):
    # Top-k 10% at 32 ranks: a gather would move 32 * 0.8 / 2 > 1 dense, so dense; two-phase compresses.
    concrete = TopK(0.1)
    assert choose_route(concrete, SHAPE, torch.float32, 32) == "dense"
    assert choose_route(concrete, SHAPE, torch.float32, 32, byte_optimal=True) == "scattergather"
    lines = run_first_step(32, None, caplog, ratio=0.1)
    assert len(lines) == 1 and "32 workers" in lines[0]
