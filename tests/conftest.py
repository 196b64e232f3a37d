"""How `make test` shares the suite between its two pytest-xdist workers (``-n 2 --dist loadgroup``).

The tests that launch real jobs (``tests/distributed/``, the benchmarks' smoke runs in
``tests/benchmarks/``) run one after another on one worker: each job's ranks already share the
machine's cores, and two jobs at once would make the timing-bound checks (a stalled or dead rank
named within seconds) race each other. The one-process tests share out over both workers, so they
fill the cores a job leaves idle while its ranks start up and wait for each other.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Waiting OpenMP threads sleep instead of spinning. The suite runs more threads than the machine
# has cores (two test processes, jobs of four ranks, each with torch's threads), and a spinning
# thread takes the core from the one that has work: a small torch operation then waits milliseconds
# for its parallel region. Set before torch is imported (here, or by `make test` for every process
# it starts); the results are the same bits either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: Folders whose tests launch processes (``horovodrun``, ``torchrun``, benchmark runs).
LAUNCHING = ("distributed", "benchmarks")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        folder = Path(item.path).relative_to(tests).parts[0]
        if folder in LAUNCHING:
            item.add_marker(pytest.mark.xdist_group("launches"))
