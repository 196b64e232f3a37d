"""ScatterGather under real launchers: Horovod's all-to-all and allgather (horovodrun, Gloo and MPI)
and torch.distributed's (torchrun, Gloo), 2, 3 (uneven shards) and 4 ranks, every case bit for bit
against the independent two-phase reference, once more along the device path
(``GRACE_LEGACY_DEVICE_PATH=1``); and the routes of a trained model with ``communicator="auto"``
and by default (``scatter_gather_worker.py``)."""

import pytest

from tests.distributed.launcher import run_checks, run_torchrun_checks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("controller", "np"), [("gloo", 2), ("gloo", 3), ("mpi", 4)])
def test_horovod_matches_the_two_phase_reference(controller, np, tmp_path):
    run_checks("scatter_gather_worker.py", np, controller, tmp_path, "--engine", "horovod", timeout=900)


def test_horovod_matches_the_two_phase_reference_on_the_device_path(tmp_path):
    """Every rank on the path a GPU's tensors take (``GRACE_LEGACY_DEVICE_PATH=1``)."""
    reports = run_checks("scatter_gather_worker.py", 3, "gloo", tmp_path, "--engine", "horovod", timeout=900,
                         extra_env={"GRACE_LEGACY_DEVICE_PATH": "1"})
    assert all(report["device_path"] for report in reports.values())


@pytest.mark.parametrize("np", [3, 4])
def test_torch_distributed_matches_the_two_phase_reference(np, tmp_path):
    run_torchrun_checks("scatter_gather_worker.py", np, tmp_path, "--engine", "torch", timeout=900)
