"""Over real horovodrun -np 4, under Gloo and MPI: every registered compressor case
(``tests/registry.py``) equals an independent aggregation of each rank's decompressed payload, with
the model trained in float32, float16 and bfloat16 (one launch per controller runs every family in
the three; one test per family and controller reads its cases' checks); and once more under Gloo
with ``GRACE_LEGACY_DEVICE_PATH=1``, every rank on the path a GPU's tensors take
(:mod:`grace_legacy.runtime.paths`), on two ranks."""

import pytest

from tests.distributed.launcher import CONTROLLERS, failed_checks, horovodrun, reports_of, run_checks
from tests.registry import FAMILIES, zoo_cases

pytestmark = pytest.mark.distributed

DTYPES = ("float32", "float16", "bfloat16")
NP = 4


@pytest.fixture(scope="module", params=CONTROLLERS)
def zoo_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"zoo-{request.param}")
    result = horovodrun("zoo_worker.py", NP, request.param, out, "--dtypes", *DTYPES, timeout=2400)
    return reports_of(result, "zoo_worker.py", NP, out)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_compressor_matches_its_reference(zoo_run, family):
    labels = [case.label for case in zoo_cases(family)]
    assert failed_checks(zoo_run, *(f"{label} in " for label in labels)) == []
    assert [label for label in zoo_run[0]["cases"] if label in labels] == labels
    assert zoo_run[0]["dtypes"] == list(DTYPES)


def test_every_compressor_matches_its_reference_on_the_device_path(tmp_path):
    # Two ranks: the device path's own launch, kept small (the default routes are those of any
    # number of ranks; the scatter-gather's device path: test_scatter_gather.py).
    reports = run_checks("zoo_worker.py", 2, "gloo", tmp_path, timeout=1200,
                         extra_env={"GRACE_LEGACY_DEVICE_PATH": "1"})
    assert all(report["device_path"] for report in reports.values())
    assert reports[0]["cases"] == [case.label for family in FAMILIES for case in zoo_cases(family)]
