"""Over real horovodrun -np 4 (MPI), every compressor/memory pair of the registry, the schedules and
the communicators, in one launch (``every_pair_worker.py``): non-finite gradients make
GradScaler skip exactly as without compression and leave no non-finite state, and ranks never
diverge."""

import pytest

from tests.distributed.launcher import run_checks
from tests.registry import every_pair

pytestmark = pytest.mark.distributed


def test_every_pair_survives_nonfinite_steps_and_ranks_agree(tmp_path):
    reports = run_checks("every_pair_worker.py", 4, "mpi", tmp_path, timeout=600)
    expected = [label for label, _ in every_pair()]
    assert list(reports[0]["setups"]) == expected
    names = {check["name"] for check in reports[0]["checks"]}
    for label in expected:  # each really ran to the end, through both poisoned steps
        assert f"{label}: parameters bit-identical on every rank" in names, label
        assert f"{label}: step 3: skipped, parameters untouched" in names, label
