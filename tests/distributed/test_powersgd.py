"""PowerSGD over real horovodrun -np 4 (Gloo and MPI) against an independent implementation,
including LEGACY's epoch-quartile ranks (6, 4, 3, 2) from the rebuttal, with the model in float32,
float16 and bfloat16: one launch per controller runs the three dtypes, one test per dtype reads
its checks."""

import pytest

from tests.distributed.launcher import CONTROLLERS, failed_checks, horovodrun, reports_of

pytestmark = pytest.mark.distributed

DTYPES = ("float32", "float16", "bfloat16")
NP = 4


@pytest.fixture(scope="module", params=CONTROLLERS)
def powersgd_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"powersgd-{request.param}")
    result = horovodrun("powersgd_worker.py", NP, request.param, out, "--dtypes", *DTYPES, timeout=600)
    return reports_of(result, "powersgd_worker.py", NP, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_powersgd_matches_an_independent_implementation(powersgd_run, dtype):
    assert failed_checks(powersgd_run, f"{dtype} ") == []
    names = {check["name"] for check in powersgd_run[0]["checks"]}
    assert any(name.startswith(f"{dtype} legacy powersgd quartiles: step 3") for name in names)
