"""The planner's ``expected volume`` for a model and a LEGACY schedule in the reference flags is
what a real horovodrun run of that model and schedule measures in ``stats["volume"]`` (within
1%), dense fallback included."""

import os
import re
import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO, run_checks

pytestmark = pytest.mark.distributed

FLAGS = ["--by", "both", "--group-compressions", "100,30,1;100,5,0.5", "--group-splits", "100,1000",
         "--epochs", "2"]


def test_planned_volume_is_the_measured_volume(tmp_path):
    reports = run_checks("planner_worker.py", 4, "gloo", tmp_path, *FLAGS)
    measured = reports[0]["volume"]
    assert "dense-fallback" in reports[0]["routes"], reports[0]["routes"]  # the fallback is part of the plan
    assert len({report["volume"] for report in reports.values()}) == 1
    planned = subprocess.run(
        [sys.executable, "-m", "grace_legacy", "plan", "--model", "tests.distributed.planner_worker:model",
         "--compressor", "topk", *FLAGS, "--workers", "4"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert planned.returncode == 0, planned.stderr[-3000:]
    last = planned.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"expected volume ([\d.]+)%", last)
    assert match, planned.stdout
    expected = float(match.group(1)) / 100
    assert abs(expected - measured) / measured < 0.01, (expected, measured, planned.stdout)
