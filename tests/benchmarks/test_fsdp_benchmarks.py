"""The FSDP2 benchmarks' quick runs (``benchmarks/performance/fsdp_step.py``,
``benchmarks/accuracy/fsdp_digits.py``): two workers in network namespaces complete and write
their reports. They check the pipelines, not the numbers (those are measured, not asserted); both
need root (``ip netns``, ``tc``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common.netns import unavailable_reason

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]


def run_quick(module: str, results: Path) -> None:
    subprocess.run([sys.executable, "-m", module, "--quick", "--results", str(results)], cwd=REPO, check=True,
                   timeout=600)


def test_fsdp_step_quick(tmp_path):
    run_quick("benchmarks.performance.fsdp_step", tmp_path)
    text = (tmp_path / "fsdp_step.md").read_text()
    for way in ("| dense |", "| QSGD(64) |", "| U8bit |", "| Top-k 0.01 + EF |", "| compute only |"):
        assert way in text
    result = json.loads((tmp_path / "fsdp_step.json").read_text())
    record = result["runs"]["2"]["models"]["mlp"]
    assert record["all_gather_bytes"] > 0 and record["dense_reduce_scatter_bytes"] > 0
    assert set(record["memory"]) == {"QSGD(64)", "U8bit", "Top-k 0.01 + EF"}
    assert (tmp_path / "fsdp_step.png").stat().st_size > 1000


def test_fsdp_digits_quick(tmp_path):
    run_quick("benchmarks.accuracy.fsdp_digits", tmp_path)
    text = (tmp_path / "fsdp_digits.md").read_text()
    assert "| dense |" in text and "| qsgd |" in text and "## Memory per rank" in text
    summary = json.loads((tmp_path / "fsdp_digits.json").read_text())["summary"]
    assert summary["qsgd"]["volume"] < 0.5 and summary["qsgd"]["link_bytes"] > 0
