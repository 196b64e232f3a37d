"""Over real horovodrun -np 4, under Gloo and MPI: every registered compressor case
(``tests/registry.py``) equals an independent aggregation of each rank's decompressed payload, with
the model trained in float32, float16 and bfloat16 (one launch per family and controller runs the
three); and once more under Gloo with ``GRACE_LEGACY_DEVICE_PATH=1``, every rank on the path a GPU's
tensors take (:mod:`grace_legacy.runtime.paths`), on two ranks."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks
from tests.registry import FAMILIES, zoo_cases

pytestmark = pytest.mark.distributed

DTYPES = ("float32", "float16", "bfloat16")
# Four ranks on fewer cores: Open MPI's busy-polling ranks otherwise starve each other (same
# collectives and results, a fraction of the wall time).
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_every_compressor_matches_its_reference(controller, family, tmp_path):
    reports = run_checks("zoo_worker.py", 4, controller, tmp_path, "--cases", family, "--dtypes", *DTYPES,
                         timeout=900, extra_env=YIELD)
    assert reports[0]["cases"] == [case.label for case in zoo_cases(family)]
    assert reports[0]["dtypes"] == list(DTYPES)


def test_every_compressor_matches_its_reference_on_the_device_path(tmp_path):
    # Two ranks: the device path's own launch, kept small (the default routes are those of any
    # number of ranks; the scatter-gather's device path: test_scatter_gather.py).
    reports = run_checks("zoo_worker.py", 2, "gloo", tmp_path, timeout=1200,
                         extra_env={"GRACE_LEGACY_DEVICE_PATH": "1"})
    assert all(report["device_path"] for report in reports.values())
    assert reports[0]["cases"] == [case.label for family in FAMILIES for case in zoo_cases(family)]
