"""Over real horovodrun -np 4, Gloo and MPI: DGC's warm-up (DGC densities and QSGD levels),
Accordion and L-GreCo are exact on the wire at the parameter each chose, every rank makes the same
decisions, and L-GreCo's broadcast overrides ranks whose own state would decide otherwise, also
on a process set that leaves global rank 0 out."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_adaptive_schedules_are_exact_and_agree(controller, tmp_path):
    reports = run_checks("adaptive_worker.py", 4, controller, tmp_path)
    names = {check["name"] for check in reports[0]["checks"]}
    for label, last_step in (("dgc-warmup", 3), ("qsgd-warmup", 2), ("accordion", 5), ("lgreco", 5),
                             ("lgreco/process-set", 3)):
        assert any(name.startswith(f"{label}: step {last_step} ") for name in names), label
    assert any("against brute force" in name or "meets the uniform error" in name for name in names)
    assert any(name.startswith("lgreco: this rank's own") for name in {c["name"] for c in reports[1]["checks"]})
