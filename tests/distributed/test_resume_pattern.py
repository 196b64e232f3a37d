"""Horovod's resume pattern (rank 0 loads a checkpoint, then ``hvd.broadcast_optimizer_state``)
with grace_legacy imported, under real horovodrun: no hang for any optimizer, with Horovod's own
compression, a grace_legacy compressor or a LEGACY schedule, and every rank ends with rank 0's
optimizer state."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_broadcast_optimizer_state_after_import(controller, tmp_path):
    # A hang (the failure this guards against) ends at the timeout with the job's output.
    reports = run_checks("resume_pattern_worker.py", 2, controller, tmp_path, timeout=150)
    names = {check["name"] for check in reports[1]["checks"]}
    assert sum(name.endswith("broadcast_optimizer_state returned") for name in names) == 4 * 11
