"""The byte-cost model and the dense fallback it drives (``runtime/cost.py``): a gather costs more
than a ring allreduce of the dense tensor exactly past its boundary, a rank never hands over more
bytes than a dense send, and the fallback is recorded and can be turned off."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from grace_legacy import Grace, ScatterGather, TopK
from grace_legacy.runtime.cost import gather_costs_more, scatter_gather_bytes
from tests.helpers import run_ranks


@pytest.mark.parametrize("packed,dense,world,expected", [
    (8, 16, 4, True), (7, 16, 4, False), (15, 16, 2, False), (16, 16, 2, True), (16, 16, 1, True),
    (100, 1000, 8, False), (250, 1000, 8, True)])
def test_gather_costs_more_at_its_boundary(packed, dense, world, expected):
    assert gather_costs_more(packed, dense, world) is expected


@given(world=st.integers(1, 5), ratio=st.floats(0.001, 1.0), numel=st.integers(1, 3000),
       communicator=st.sampled_from([None, "auto"]))
@settings(max_examples=40, deadline=None)
@example(world=4, ratio=0.5, numel=15, communicator="auto")  # the smallest shard's owner carries more than the mean
def test_a_rank_never_hands_over_more_than_dense(world, ratio, numel, communicator):
    def body(backend):
        bundle = Grace(TopK(ratio), bucket_bytes=0, communicator=communicator)
        g = torch.randn(numel, generator=torch.Generator().manual_seed(backend.rank()))
        bundle.start(g, "w", backend, True)()
        return bundle.stats

    for stats in run_ranks(world, body):
        assert stats["wire_bytes"] <= stats["wire_dense"]
        assert set(stats["tensors_by_route"]) <= {"allgather", "scattergather", "dense-fallback", "dense"}


def test_fallback_is_recorded_and_can_be_turned_off():
    """Top-k 0.6 of 100 elements at 4 ranks: dense costs 600 link bytes, the scatter-gather 720 (4
    segments of 15 entries each way), the gather 1440; without the fallback, the gather by default
    and the cheaper of the two with ``communicator="auto"``."""
    def body(backend, fallback, communicator=None):
        bundle = Grace(TopK(0.6), bucket_bytes=0, dense_fallback=fallback, communicator=communicator)
        bundle.start(torch.randn(100), "w", backend, True)()
        return bundle.stats["tensors_by_route"]

    assert run_ranks(4, lambda b: body(b, True))[0] == {"dense-fallback": 1}
    assert run_ranks(4, lambda b: body(b, True, "auto"))[0] == {"dense-fallback": 1}
    assert run_ranks(4, lambda b: body(b, False))[0] == {"allgather": 1}
    assert run_ranks(4, lambda b: body(b, False, "auto"))[0] == {"scattergather": 1}


@pytest.mark.parametrize("world,numel,ratio", [(3, 10, 0.5), (4, 15, 0.5), (5, 3, 0.5), (4, 1001, 0.1), (3, 7, 0.3)])
def test_the_busiest_scatter_gather_link_is_the_model_s(world, numel, ratio):
    """The scatter-gather's link bytes, measured per rank, have the model's mean and maximum."""
    def body(backend):
        bundle = Grace(TopK(ratio), bucket_bytes=0, communicator=ScatterGather(), dense_fallback=False)
        bundle.start(torch.randn(numel, generator=torch.Generator().manual_seed(backend.rank())), "w", backend,
                     True)()
        assert bundle.stats["tensors_by_route"] == {"scattergather": 1}
        return bundle.stats["wire_bytes"]

    wires = run_ranks(world, body)
    assert max(wires) == scatter_gather_bytes(TopK(ratio), numel, torch.float32, world, busiest=True)
    assert sum(wires) / world == pytest.approx(scatter_gather_bytes(TopK(ratio), numel, torch.float32, world))
