"""Horovod initialised from an mpi4py communicator works with grace_legacy compression under
``horovodrun --mpi`` (4 ranks): ``hvd.init(comm=MPI.COMM_WORLD)``, then, after ``hvd.shutdown()``,
``hvd.init(comm=half)`` with the world split in two halves, each half averaging exactly over its
own members (checked against the members' gradients exchanged through mpi4py) and training apart
from the other."""

import pytest

from tests.distributed.launcher import run_checks

pytestmark = pytest.mark.distributed


def test_horovod_on_mpi4py_communicators(tmp_path):
    pytest.importorskip("mpi4py")
    reports = run_checks("mpi4py_worker.py", 4, "mpi", tmp_path)
    names = {check["name"] for check in reports[3]["checks"]}
    assert "world: step 2 fc1.weight: mean over the communicator's members" in names
    assert "halves: step 2 fc1.weight: mean over the communicator's members" in names
    assert "halves: the two halves trained apart" in names
