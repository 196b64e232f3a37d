"""The elastic digits example trains to a useful accuracy with compressed gradients under elastic
``horovodrun`` (a discovery script listing ``localhost:2``) and prints its summary line."""

from __future__ import annotations

import re
import sys

import pytest

from tests.distributed.launcher import HOROVODRUN, run_command

pytestmark = pytest.mark.distributed

TIMEOUT_S = 300
SUMMARY = re.compile(r"test accuracy (?P<accuracy>[\d.]+)% \| (?P<workers>\d+) workers at the end, (?P<resets>\d+) "
                     r"resets? \| rank 0 sent [\d.]+ MB vs [\d.]+ MB dense: volume (?P<volume>[\d.]+)%")


def test_the_elastic_example_trains_with_compression(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    cmd = [str(HOROVODRUN), "-np", "2", "--min-np", "1", "--max-np", "2", "--host-discovery-script", str(script),
           "--network-interface", "lo", sys.executable, "examples/train_digits_elastic.py", "--epochs", "4"]
    result = run_command(cmd, TIMEOUT_S)
    output = result.stdout
    assert result.returncode == 0, output[-6000:]
    summary = SUMMARY.search(output)
    assert summary, output[-6000:]
    print(summary.group(0))
    assert summary["workers"] == "2" and summary["resets"] == "0"
    assert float(summary["accuracy"]) > 80 and float(summary["volume"]) < 100
