"""A fault at every point of a step (every collective launch and wait, every compress,
decompress and memory update), for every route and compressor family, on Horovod's optimizer
(``horovodrun``, Gloo and MPI) and on the DDP hook (``torchrun``): the training loop sees only the
engine's own error, and recovery (``TorchState.restore()``, or a checkpoint loaded into fresh
objects) continues bit for bit as if nothing had failed (``fault_sweep_worker.py``)."""

import pytest

from tests.distributed.fault_sweep_worker import ALIGNED_ONLY, CONFIGS, WHOLE_ON_DDP
from tests.distributed.launcher import run_checks, run_torchrun_checks

pytestmark = pytest.mark.distributed

#: Under MPI and on the DDP hook, one configuration per route and family (Gloo runs them all).
SUBSET = ["allgather topk+residual", "allreduce fp16", "rounds powersgd", "dense and fallback legacy",
          "two-phase topk+residual", "quantizer qsgd+residual", "signs signum", "headers threshold", "broadcast topk"]


def assert_every_point_swept(reports, configs, aligned_only=None, whole=()):
    """Every configuration had faults at its launches, waits and memory updates (on the DDP hook,
    ``ALIGNED_ONLY``'s configurations at their launches and waits, and ``whole``'s, sent a bucket
    at a time, at the launches and waits of their buckets, with no memory update to fault)."""
    for rank, report in reports.items():
        points = report["points"]
        assert sorted(points) == sorted(configs), f"rank {rank} swept {sorted(points)}"
        for label in configs:
            kinds = {"launch", "wait", "update"} & set((aligned_only or {}).get(label, ("launch", "wait", "update")))
            if label in whole:
                assert points[label]["update"] == 0, (label, points[label])
                kinds -= {"update"}
            assert all(points[label][kind] > 0 for kind in kinds), (label, points[label])


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovod_optimizer_recovers_from_a_fault_anywhere(controller, tmp_path):
    configs = list(CONFIGS) if controller == "gloo" else SUBSET
    reports = run_checks("fault_sweep_worker.py", 2, controller, tmp_path, "--configs", ",".join(configs),
                         timeout=900)
    assert_every_point_swept(reports, configs)


def test_ddp_hook_recovers_from_a_fault_anywhere(tmp_path):
    reports = run_torchrun_checks("fault_sweep_worker.py", 2, tmp_path, "--engine", "ddp",
                                  "--configs", ",".join(SUBSET), timeout=900)
    assert_every_point_swept(reports, SUBSET, ALIGNED_ONLY, WHOLE_ON_DDP)
