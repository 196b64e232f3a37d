"""The CPU time each test costs, its launched jobs included: ``--cpu-top N`` lists the N costliest at
the end of the run, beside pytest's ``--durations``.

Why: `make test` runs two test processes on a machine with fewer cores than they have ranks, so a
test's wall time says more about what ran beside it than about the test; the CPU it used (its
process's and every finished child's: ``horovodrun``, ``torchrun`` and their ranks) is what the
suite's time is made of. A module-scoped fixture's launch counts to the first test that uses it.
"""

from __future__ import annotations

import resource

import pytest

_SPENT: dict[str, float] = {}


def _cpu_seconds() -> float:
    """User and system CPU of this process and of its waited-for children (and theirs), so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-top", type=int, default=0, metavar="N",
                     help="list the N tests that used the most CPU time, their launched jobs included")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    before = _cpu_seconds()
    yield
    _SPENT[item.nodeid] = _cpu_seconds() - before


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    top = config.getoption("--cpu-top")
    if not top or not _SPENT:
        return
    terminalreporter.section(f"most CPU time (of {sum(_SPENT.values()):.0f} s in all, launched jobs included)")
    for nodeid, seconds in sorted(_SPENT.items(), key=lambda item: -item[1])[:top]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
