"""grace_legacy.fsdp under real ``torchrun`` (Gloo, CPU), one launch per number of ranks, each
checking every compressor that can travel in a reduce-scatter against the independent reference
(``fsdp_worker.py``, ``tests/fsdp_reference.py``): 2 ranks along the device path
(``GRACE_LEGACY_DEVICE_PATH=1``, the code a GPU runs), 3 ranks (uneven shards) with FSDP's options,
checkpoints, non-finite gradients and the refusals, 4 ranks (a rank whose chunk is all padding)
with HSDP's refusal besides. Compressors run on the device path in every launch (their CPU passes
are compiled by numba on first use, which takes longer than the checks); FSDP's own CPU branch is
checked in the 3- and 4-rank launches."""

import pytest

from tests.distributed.launcher import run_torchrun_checks

pytestmark = pytest.mark.distributed


def test_two_ranks_on_the_device_path(tmp_path):
    reports = run_torchrun_checks("fsdp_worker.py", 2, tmp_path, timeout=600,
                                  extra_env={"GRACE_LEGACY_DEVICE_PATH": "1"})
    assert all(report["device_path"] for report in reports.values())


def test_three_ranks_with_fsdp_options_and_refusals(tmp_path):
    run_torchrun_checks("fsdp_worker.py", 3, tmp_path, "--options", timeout=600)


def test_four_ranks_with_padding_and_hsdp_refused(tmp_path):
    run_torchrun_checks("fsdp_worker.py", 4, tmp_path, "--refusals", timeout=600)
