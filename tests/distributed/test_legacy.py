"""Over real horovodrun -np 4: LEGACY's synchronized gradients equal the reference at the
density the rule picks, by layer, by epoch across phase changes, and both; dense layers equal a
plain allreduce bit for bit; a budget-matched schedule spends what uniform Top-k spends."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks

pytestmark = pytest.mark.distributed

# Bit-exact comparison with a plain allreduce needs both to run unfused (see the worker).
NO_FUSION = {"HOROVOD_FUSION_THRESHOLD": "0"}


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_legacy_schedules_match_the_rules(controller, tmp_path):
    reports = run_checks("legacy_worker.py", 4, controller, tmp_path, extra_env=NO_FUSION)
    names = {check["name"] for check in reports[0]["checks"]}
    for label in ["layer", "layer+residual", "epoch", "both"]:
        assert any(name.startswith(f"{label}: step 2") for name in names), label
    assert any(name.endswith("(bit-exact)") for name in names)
    budget = reports[0]["budget"]
    assert abs(budget["matched"] - budget["uniform"]) / budget["uniform"] < 0.02
