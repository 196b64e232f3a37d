"""Ranks that share a host name but not a network (network namespaces on one machine, as
containers would) reach the progress board that rank 0 hosts: a rank that took loopback for the
host's address found nothing there, lost tens of seconds to the store client's retries when the
board opened, worked without a board, and could abort at exit while a client was still retrying.
Real Horovod (Gloo) on real namespaces; skipped where they cannot be made (not root)."""

import json
import sys

import pytest

from grace_legacy.backends.board import ANSWER_S
from tests.distributed.launcher import REPO, WORKERS

pytestmark = pytest.mark.distributed

RANKS = 3


def test_ranks_in_separate_network_namespaces_reach_the_board(tmp_path):
    from benchmarks.common.netns import Cluster, HorovodJob, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with Cluster(RANKS) as cluster, HorovodJob(cluster, [sys.executable, str(WORKERS / "board_namespaces_worker.py"),
                                                         "--out", str(tmp_path)], tmp_path / "logs",
                                               env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                                               cwd=REPO) as job:
        job.wait(timeout=180)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    # The situation itself: one host name, no address in common.
    assert len({report["host"] for report in reports}) == 1
    addresses = [set(report["addresses"]) for report in reports]
    assert all(addresses) and not set.intersection(*addresses)
    for rank, report in enumerate(reports):
        assert report["unreachable"] is None, (rank, report["unreachable"])
        assert report["opened_s"] < ANSWER_S, (rank, report["opened_s"])
        assert report["beats"] == {str(r): [1, "board check"] for r in range(RANKS)}, (rank, report["beats"])
