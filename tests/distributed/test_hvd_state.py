"""Over real horovodrun: non-finite gradients make GradScaler skip exactly as without compression
and leave no non-finite state, ranks never diverge (every compressor/memory pair of the registry,
the schedules and the communicators, in one launch), and a run resumed from a checkpoint in fresh
processes ends bit-identical to an uninterrupted one (on 2 ranks under Gloo and 4 under MPI)."""

import pytest
from launcher import run_checks

from tests.registry import RESUME_SETUPS, every_pair

pytestmark = pytest.mark.distributed

# Four ranks on fewer cores: Open MPI's busy-polling ranks otherwise starve each other.
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def test_every_pair_survives_nonfinite_steps_and_ranks_agree(tmp_path):
    reports = run_checks("every_pair_worker.py", 4, "mpi", tmp_path, extra_env=YIELD, timeout=600)
    expected = [label for label, _ in every_pair()]
    assert list(reports[0]["setups"]) == expected
    names = {check["name"] for check in reports[0]["checks"]}
    for label in expected:  # each really ran to the end, through both poisoned steps
        assert f"{label}: parameters bit-identical on every rank" in names, label
        assert f"{label}: step 3: skipped, parameters untouched" in names, label


@pytest.mark.parametrize("np,controller", [(2, "gloo"), (4, "mpi")])
def test_a_resumed_run_ends_bit_identical(np, controller, tmp_path):
    run_checks("resume_worker.py", np, controller, tmp_path, "--phase", "first", extra_env=YIELD, timeout=600)
    reports = run_checks("resume_worker.py", np, controller, tmp_path, "--phase", "resume", extra_env=YIELD,
                         timeout=600)
    names = {check["name"] for check in reports[0]["checks"]}
    for label, _ in RESUME_SETUPS:
        assert f"{label}: resumed parameters bit-identical to the uninterrupted run's" in names, label
