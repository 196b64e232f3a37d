"""The planner's ``expected volume`` for a model and a LEGACY schedule in the reference flags is
the wire volume a real horovodrun run of that model and schedule measures (the ranks'
``stats["wire_bytes"]`` against their ``stats["wire_dense"]``; a scatter-gather puts more on some
ranks' links than on others'), dense fallback included, for the default bundle and for
``communicator="auto"``."""

import os
import re
import subprocess
import sys

import pytest

from tests.distributed.launcher import REPO, run_checks

pytestmark = pytest.mark.distributed

FLAGS = ["--by", "both", "--group-compressions", "100,60,1;100,5,0.5", "--group-splits", "100,1000",
         "--epochs", "2"]


def test_planned_volume_is_the_measured_volume(tmp_path):
    reports = run_checks("planner_worker.py", 4, "gloo", tmp_path, *FLAGS)
    for communicator in ("default", "auto"):
        runs = [report[communicator] for report in reports.values()]
        measured = sum(r["wire_bytes"] for r in runs) / sum(r["wire_dense"] for r in runs)
        routes = runs[0]["routes"]
        assert "dense-fallback" in routes, routes  # the fallback is part of the plan
        assert ("scattergather" in routes) == (communicator == "auto"), routes
        planned = subprocess.run(
            [sys.executable, "-m", "grace_legacy", "plan", "--model", "tests.distributed.planner_worker:model",
             "--compressor", "topk", *FLAGS, "--workers", "4", "--communicator", communicator],
            capture_output=True, text=True, timeout=120, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        assert planned.returncode == 0, planned.stderr[-3000:]
        last = planned.stdout.strip().splitlines()[-1]
        match = re.fullmatch(r"expected volume ([\d.]+)%", last)
        assert match, planned.stdout
        expected = float(match.group(1)) / 100
        assert abs(expected - measured) / measured < 0.01, (communicator, expected, measured, planned.stdout)
