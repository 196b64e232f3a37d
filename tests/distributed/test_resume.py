"""Over real horovodrun (2 ranks under Gloo, 4 under MPI): a run resumed from a checkpoint in fresh
processes ends bit-identical to an uninterrupted one, for every set-up of
``tests.registry.RESUME_SETUPS`` (``resume_worker.py``: ``--phase first`` saves, ``--phase
resume`` loads and finishes)."""

import pytest

from tests.distributed.launcher import run_checks
from tests.registry import RESUME_SETUPS

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("np,controller", [(2, "gloo"), (4, "mpi")])
def test_a_resumed_run_ends_bit_identical(np, controller, tmp_path):
    run_checks("resume_worker.py", np, controller, tmp_path, "--phase", "first", timeout=600)
    reports = run_checks("resume_worker.py", np, controller, tmp_path, "--phase", "resume",
                         timeout=600)
    names = {check["name"] for check in reports[0]["checks"]}
    for label, _ in RESUME_SETUPS:
        assert f"{label}: resumed parameters bit-identical to the uninterrupted run's" in names, label
