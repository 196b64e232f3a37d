"""The link-byte benchmark's counting, in one process: the backend-level count of each collective's
link bytes (benchmarks/common/link_counters.py) against the bundle's own ``stats["wire_bytes"]``
on in-process ranks, and how a step is charged for background traffic."""

import threading

import pytest
import torch

from benchmarks.common.link_counters import BASE_HEADER_BYTES, CollectiveCounter, LinkCount, ring_allreduce_bytes
from benchmarks.performance.link_bytes import charge_overheads, idle_traffic
from grace_legacy import QSGD, Allgather, Grace, ScatterGather, SignSGD, TopK
from tests.helpers import ThreadBackend, World


def count_by_rank(size: int, body) -> tuple[list[float], list]:
    """Run ``body(backend)`` on ``size`` in-process ranks (threads), each rank's collectives counted
    by a counter of its own (installed on a subclass of the backend per rank); the counts and the
    results."""
    world = World(size)
    counters, backends = [], []
    for rank in range(size):
        backend_class = type(f"Rank{rank}Backend", (ThreadBackend,), {})
        counters.append(CollectiveCounter().install(backend_class))
        backends.append(backend_class(world, rank))
    results: list = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(backends[rank])
        except BaseException as error:  # re-raised below
            errors.append(error)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), "a rank never finished"
    return [counter.total for counter in counters], results


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("make", [lambda: Grace(QSGD(127), communicator=ScatterGather(), dense_fallback=False),
                                  lambda: Grace(SignSGD(), communicator=ScatterGather(), dense_fallback=False),
                                  lambda: Grace(TopK(0.01), communicator=ScatterGather(), dense_fallback=False),
                                  lambda: Grace(TopK(0.01), communicator=Allgather(), dense_fallback=False),
                                  lambda: Grace(QSGD(127), communicator=Allgather(), dense_fallback=False)],
                         ids=["qsgd-sg", "signsgd-sg", "topk-sg", "topk-ag", "qsgd-ag"])
def test_counted_link_bytes_equal_wire_bytes(size, make):
    """Per rank, the counter's link bytes for a step's collectives are the bundle's wire_bytes."""
    bundles = [make() for _ in range(size)]
    shapes = [(300, 7), (11,), (1000,)]

    def body(backend):
        generator = torch.Generator().manual_seed(backend.rank())
        bundle = bundles[backend.rank()]
        pending = [bundle.start(torch.randn(shape, generator=generator), f"t{i}", backend, True)
                   for i, shape in enumerate(shapes)]
        for finish in pending:
            finish()
        return bundle.stats["wire_bytes"]

    counted, wire = count_by_rank(size, body)
    assert counted == pytest.approx(wire, rel=1e-12)
    assert min(wire) > 0


def test_counter_formulas_and_uninstall():
    """An allreduce counts 2(P-1)/P of its bytes, an allgather the others' parts (of different
    sizes here), an all-to-all what leaves for the others, a broadcast (P-1)/P of its bytes, each
    call by its kind; uninstall puts the class back."""
    def body(backend):
        rows = backend.rank() + 1
        handles = [backend.allreduce_async(torch.zeros(10), "r", False),
                   backend.allgather_async(torch.zeros(rows, 2), "g"),
                   backend.alltoall_async(torch.zeros(6, dtype=torch.uint8), [1, 2, 3], "a"),
                   backend.broadcast_async(torch.zeros(3), 0, "b")]
        for handle in handles:
            backend.wait(handle)

    counted, _ = count_by_rank(3, body)
    for rank, total in enumerate(counted):
        others = sum(r + 1 for r in range(3) if r != rank) * 2 * 4
        assert total == pytest.approx(ring_allreduce_bytes(40, 3) + others + (6 - [1, 2, 3][rank]) + 12 * 2 / 3)

    class Probe(ThreadBackend):
        pass

    original = Probe.allreduce_async
    counter = CollectiveCounter().install(Probe)
    assert Probe.allreduce_async is not original
    counter.uninstall()
    assert Probe.allreduce_async is original and ThreadBackend.allreduce_async is original


def test_link_count_payload():
    before = LinkCount(100, 200, 1, 2)
    after = LinkCount(100 + 3 * 66 + 5000, 200 + 66, 4, 3)
    moved = (after - before).as_dict(66)
    assert moved["tx_payload"] == 5000 and moved["rx_payload"] == 0  # a pure ACK carries nothing
    assert BASE_HEADER_BYTES == 54


def test_coordination_is_the_smaller_estimate():
    """A step is charged the smaller of the idle rate times its duration and its packets times the
    idle payload per packet; torch.distributed's framing is charged by calls."""
    idle = [{"s": 2.0, "tx_payload": 4000, "rx_payload": 4000, "tx_packets": 100, "rx_packets": 100}]
    step = {"s": 0.5, "tx_payload": 10_000, "rx_payload": 10_000, "tx_packets": 10, "rx_packets": 10,
            "calls": {"allgather": 2, "alltoall": 1}}
    rank = {"idle": idle, "ways": {"w": {"steps": [dict(step)]}}, "framing": {"allgather": 100.0, "alltoall": 50.0}}
    assert idle_traffic(rank) == (2000.0, 40.0)
    charge_overheads([rank], "torch")
    row = rank["ways"]["w"]["steps"][0]
    assert row["coordination"] == min(2000.0 * 0.5, 40.0 * 10) == 400.0
    assert row["framing"] == 250.0
    charge_overheads([rank], "horovod")
    assert rank["ways"]["w"]["steps"][0]["framing"] == 0.0
