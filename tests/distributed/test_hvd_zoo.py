"""Issue 4 over real horovodrun -np 4: every registered compressor case (``workers/zoo_cases_*.py``)
equals an independent aggregation of each rank's decompressed payload, under Gloo and MPI."""

import pytest
from launcher import CONTROLLERS, WORKERS, run_checks

pytestmark = pytest.mark.distributed

FAMILIES = sorted(p.stem.removeprefix("zoo_cases_") for p in WORKERS.glob("zoo_cases_*.py"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_every_compressor_matches_its_reference(controller, family, tmp_path):
    reports = run_checks("zoo_worker.py", 4, controller, tmp_path, "--cases", family, timeout=600)
    assert reports[0]["cases"], f"zoo_cases_{family}.py registers no case"
