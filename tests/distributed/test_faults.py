"""Over real horovodrun -np 4 (Gloo and MPI): ranks that disagree
all raise the same clear error, unused parameters neither hang nor corrupt the gradient, and a
killed rank ends the whole job quickly instead of hanging it."""

import json
import re
import time

import pytest

from tests.distributed.launcher import CONTROLLERS, failed_checks, horovodrun

pytestmark = pytest.mark.distributed

NP = 4
#: How soon after a rank is killed the whole job must have ended (generous: a hang is what it catches).
DEATH_BOUND_S = 60


@pytest.fixture(scope="module", params=CONTROLLERS)
def agreement_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"agreement-{request.param}")
    result = horovodrun("faults_worker.py", NP, request.param, out, "--scenario", "agreement", timeout=300)
    reports = {rank: json.loads((out / f"rank{rank}.json").read_text())
               for rank in range(NP) if (out / f"rank{rank}.json").exists()}
    assert sorted(reports) == list(range(NP)), f"ranks without a report\n{result.stdout[-6000:]}"
    return result, reports


@pytest.mark.parametrize("compression", ["topk", "powersgd"])
def test_unused_parameters_take_part_with_zeros(agreement_run, compression):
    _, reports = agreement_run
    assert failed_checks(reports, f"{compression}:") == []


@pytest.mark.parametrize("label", ["schedule", "epoch"])
def test_every_rank_raises_the_same_error_for_a_different_schedule(agreement_run, label):
    _, reports = agreement_run
    assert failed_checks(reports, f"{label}:") == []
    assert len({report["messages"][label] for report in reports.values()}) == 1


def output_by_rank(stdout: str) -> dict[str, str]:
    """Each rank's stderr, reassembled: under MPI a rank's line can arrive in fragments, each with
    its own ``[1,r]<stderr>:`` tag, interleaved with other ranks' fragments."""
    pieces = re.split(r"\[(?:1,)?(\d)\]<stderr>:", stdout)
    by_rank: dict[str, str] = {}
    for rank, text in zip(pieces[1::2], pieces[2::2], strict=True):
        by_rank[rank] = by_rank.get(rank, "") + text
    return by_rank


def test_a_different_model_ends_every_rank_with_the_message(agreement_run):
    result, reports = agreement_run
    assert result.returncode != 0
    messages = {report["messages"]["model"] for report in reports.values()}
    assert len(messages) == 1
    (message,) = messages
    assert "ranks 0, 1, 3: 7 entries; rank 2: 9 entries, has extra.bias[8] float32, extra.weight[8, 8] float32" \
        in message, message
    # Each rank's own traceback reaches the log, so every rank exited because of it.
    ranks_raising = {rank for rank, text in output_by_rank(result.stdout).items()
                     if "grace_legacy.consistency.RanksDisagree" in text}
    assert ranks_raising == {str(r) for r in range(NP)}, result.stdout[-6000:]


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_a_killed_rank_ends_the_job_quickly(controller, tmp_path):
    result = horovodrun("faults_worker.py", NP, controller, tmp_path, "--scenario", "dead",
                        timeout=300)
    ended = time.time()
    assert result.returncode != 0, result.stdout[-6000:]
    killed_at = json.loads((tmp_path / "killed_at.json").read_text())
    print(f"{controller}: the job ended {ended - killed_at:.1f} s after rank 2 was killed")
    assert ended - killed_at < DEATH_BOUND_S, result.stdout[-6000:]
    # The launcher names the dead rank: Gloo's horovodrun and Open MPI's mpirun each in its words.
    named = {"gloo": "Process 2 exit with status code 137", "mpi": "process rank 2 with PID"}[controller]
    assert named in result.stdout, result.stdout[-6000:]
