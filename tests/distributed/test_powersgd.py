"""PowerSGD over real horovodrun -np 4 (Gloo and MPI) against an independent implementation,
including LEGACY's epoch-quartile ranks (6, 4, 3, 2) from the rebuttal."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_powersgd_matches_an_independent_implementation(controller, tmp_path):
    reports = run_checks("powersgd_worker.py", 4, controller, tmp_path)
    names = {check["name"] for check in reports[0]["checks"]}
    assert any(name.startswith("legacy powersgd quartiles: step 3") for name in names)
