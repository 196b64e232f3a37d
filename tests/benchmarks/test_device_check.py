"""The device check (``scripts/device_check.sh``, ``python -m benchmarks.device_check``) run here as
far as a CPU allows: ``--device cpu --quick`` runs every stage it runs on a GPU, with CPU tensors
along the device path and Gloo for NCCL, real torchrun launches included, so that the command
works the first time a GPU is lent. Checks that every stage ran and passed and that the report is
where the caller said."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.registry import zoo_cases
from tests.two_phase import SETUPS

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed

STAGES = ["environment", "zoo in process", "same payloads on the CPU", "ddp gloo 1 rank", "ddp gloo 2 ranks",
          "fsdp gloo 2 ranks", "throughput"]


def test_the_device_check_runs_every_stage_on_a_cpu(tmp_path):
    out = tmp_path / "report"
    result = subprocess.run([str(REPO / "scripts" / "device_check.sh"), str(out), "--device", "cpu", "--quick",
                             "--budget", "1500"], capture_output=True, text=True, timeout=1800, cwd=tmp_path,
                            env={**os.environ, "PYTHON": sys.executable})
    report_text = (out / "gpu.md").read_text() if (out / "gpu.md").exists() else "(no report)"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + report_text[-6000:]
    report = json.loads((out / "gpu.json").read_text())
    assert report["ok"] and [stage["name"] for stage in report["stages"]] == STAGES
    statuses = {stage["name"]: stage["status"] for stage in report["stages"]}
    assert statuses == {name: "report" if name in ("same payloads on the CPU", "throughput") else "passed"
                        for name in STAGES}
    stages = {stage["name"]: stage for stage in report["stages"]}
    assert stages["ddp gloo 2 ranks"]["data"]["cases"] == len(zoo_cases()) > 20
    assert stages["zoo in process"]["data"]["cases"] == len(zoo_cases()) + len(SETUPS)
    text = (out / "gpu.md").read_text()
    assert "**every stage passed**" in text and "Compressor throughput" in text and "PowerSGD" in text
    assert text.index("<!-- begin device_check -->") < text.index("<!-- begin throughput -->")
    assert (out / "throughput.png").stat().st_size > 1000
