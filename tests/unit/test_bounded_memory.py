"""Bounded memory: a long run keeps the library's own structures at a fixed size.

Each bundle runs 2,000 steps the way ``hvd.DistributedOptimizer`` drives it; the container
entries and tensor bytes reachable from it (residuals, momenta, warm starts, step counters,
stats, schedule histories, fusion plans) must be the same after 2,000 steps as after 200, and
Python memory allocated on grace_legacy's lines must not grow (``tracemalloc``); the threaded
stand-in for Horovod keeps nothing either. The numbers themselves are measured and reported by
``benchmarks/performance/memory.py``; the schedules' history bounds are in ``test_history.py``.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from benchmarks.performance.memory import Run, SoloBackend, structure_size, traced_bytes
from grace_legacy import DGC, EF21, Accordion, DGCWarmup, Grace, Legacy, LGreCo, PowerSGD, RandomK, Signum, TopK
from tests.helpers import CALLS_KEPT, ThreadBackend, World, run_ranks

SHAPES = {"fc.weight": (16, 24), "fc.bias": (24,)}
EARLY, LATE = 200, 2000

# Every kind of per-tensor state (the stateless compressors are in the benchmark), memory and
# schedule. Schedules pass all their phases (and a learning-rate drop every 20 steps reaches
# Accordion) before step 200, so that step 2000 sees
# no route, label or configured copy that step 200 had not seen; histories are bounded small so
# they are full by then.
CASES = {
    "TopK + Residual": lambda: Grace(TopK(0.1)),
    "RandomK + EF21": lambda: Grace(RandomK(0.1, seed=1), memory=EF21()),
    "DGC + DGCMemory": lambda: Grace(DGC(0.1, min_samples=16)),
    "Signum": lambda: Grace(Signum(0.9)),
    "PowerSGD": lambda: Grace(PowerSGD(2)),
    "Legacy": lambda: Grace(Legacy(TopK(), by="both", values=[[1.0, 0.1], [0.1, 0.01], [None, 0.05]],
                                   splits=[100], epochs=6, steps_per_epoch=20)),
    "DGCWarmup": lambda: Grace(DGCWarmup(DGC(min_samples=16), target=0.01, warmup_epochs=4, steps_per_epoch=20)),
    "Accordion": lambda: Grace(Accordion(TopK(), low=0.2, high=0.02, interval=5, history=4)),
    "LGreCo": lambda: Grace(LGreCo(TopK(), [1.0, 0.2, 0.05], reference=0.2, interval=10, resolution=50, history=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_structures_are_the_same_size_after_2000_steps_as_after_200(case):
    run = Run(CASES[case](), SoloBackend(), SHAPES)
    run.advance(EARLY)
    early = structure_size(run.bundle)
    run.advance(LATE)
    assert structure_size(run.bundle) == early, "(container entries, tensor bytes) grew"


#: Steps before the traced window opens. In a fresh process the first ~1,400 steps leave about
#: 230 KB traced on grace_legacy's lines (the largest part on the line that makes a bucket's
#: views) that no tensor or gc-tracked object of the run holds; after that the total moves by a
#: few KB per thousand steps, less and less. Once earlier tests have run those lines, none of it
#: shows, so starting after it makes the verdict independent of what ran before the test.
TRACED_FROM = 1_600


def test_python_memory_of_the_library_does_not_grow():
    # Traced on grace_legacy's own lines only: what PyTorch or pytest allocate does not count.
    tracemalloc.start()
    try:
        run = Run(Grace(Accordion(TopK(), low=0.2, high=0.02, interval=5, history=4)), SoloBackend(),
                  {"w": (16, 24)})
        run.advance(TRACED_FROM)
        early = traced_bytes()
        run.advance(TRACED_FROM + LATE - EARLY)
        growth = traced_bytes() - early
    finally:
        tracemalloc.stop()
    # One record of 64 bytes per step would be 115 KiB by now; live tensors' Python wrappers come
    # and go by a few KiB.
    assert growth < 32 * 1024, f"grace_legacy's Python allocations grew by {growth} bytes in {LATE - EARLY} steps"


def test_threaded_backend_forgets_finished_collectives():
    def body(backend: ThreadBackend) -> tuple:
        run = Run(Grace(TopK(0.1)), backend, SHAPES, seed=backend.rank())
        run.advance(EARLY)
        early = structure_size(run.bundle)
        run.advance(LATE // 2)
        return early, structure_size(run.bundle), len(backend.calls)

    world_results = run_ranks(2, body)
    for early, late, calls in world_results:
        assert late == early
        assert calls <= CALLS_KEPT


def test_world_keeps_no_collective_once_every_rank_has_it():
    world = World(2)
    backends = [ThreadBackend(world, r) for r in range(2)]
    for step in range(50):
        handles = [b.allreduce_async(torch.ones(3), f"t{step % 4}", average=True) for b in backends]
        for b, h in zip(backends, handles, strict=True):
            assert torch.equal(b.wait(h), torch.ones(3))
    assert world._submitted == {} and world._results == {} and world._fetched == {}
