"""Over real horovodrun -np 4, under Gloo and MPI: every registered compressor case
(``tests/registry.py``) equals an independent aggregation of each rank's decompressed payload."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks
from tests.registry import FAMILIES, zoo_cases

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_every_compressor_matches_its_reference(controller, family, tmp_path):
    reports = run_checks("zoo_worker.py", 4, controller, tmp_path, "--cases", family, timeout=600)
    assert reports[0]["cases"] == [case.label for case in zoo_cases(family)]
