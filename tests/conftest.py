"""What every test process of the suite shares (`make test` runs two at once: see the Makefile)."""

from __future__ import annotations

import gc
import os

# Waiting OpenMP threads sleep instead of spinning. The suite runs more threads than the machine
# has cores (two test processes, jobs of four ranks, each with torch's threads), and a spinning
# thread takes the core from the one that has work: a small torch operation then waits milliseconds
# for its parallel region. Set before torch is imported (here, or by `make test` for every process
# it starts); the results are the same bits either way.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `--cpu-top N`: the tests that cost the most CPU, their jobs included (`make test` lists them).
pytest_plugins = ["tests.cpu_time"]


def pytest_collection_finish(session) -> None:
    """Set aside every object the imports made (torch's: a few hundred thousand) from the garbage
    collector: they live as long as the process, yet each full collection walked them all again.
    The tests' own objects are collected as before. Workers do the same (``parse_args`` in
    ``tests/distributed/checks.py``)."""
    gc.freeze()
