"""Over real horovodrun at 2, 3, 4 and 8 ranks (Gloo and MPI): with no communicator named, Top-k and
LEGACY's synchronized gradients equal the reference (the mean of every rank's own top-k at the
density the rule picks), uniformly, by layer, by epoch across phase changes, and both, also as a
bare schedule with its error feedback; dense layers equal a plain allreduce bit for bit;
``communicator="auto"`` takes the two-phase route from 3 ranks; a budget-matched schedule spends
what uniform Top-k spends."""

import pytest

from tests.distributed.launcher import run_checks

pytestmark = pytest.mark.distributed

# Bit-exact comparison with a plain allreduce needs both to run unfused (see the worker).
ENV = {"HOROVOD_FUSION_THRESHOLD": "0"}
# Four ranks under both controllers; 2, 3 and 8 under one each (the controller moves the same
# tensors; the number of ranks decides the routes).
LAUNCHES = [("gloo", 4), ("mpi", 4), ("gloo", 2), ("mpi", 3), ("gloo", 8)]


@pytest.mark.parametrize(("controller", "np"), LAUNCHES)
def test_legacy_schedules_match_the_rules(controller, np, tmp_path):
    reports = run_checks("legacy_worker.py", np, controller, tmp_path, timeout=600, extra_env=ENV)
    names = {check["name"] for check in reports[0]["checks"]}
    for label in ["uniform", "bare", "layer", "layer+residual", "epoch", "both"]:
        assert any(name.startswith(f"{label}: step 2") for name in names), label
    assert any(name.endswith("(bit-exact)") for name in names)
    assert any(name.startswith("auto: the two-phase route") for name in names)
    budget = reports[0]["budget"]
    assert abs(budget["matched"] - budget["uniform"]) / budget["uniform"] < 0.02
