"""A rank that stays alive but stops (``SIGSTOP``), under real horovodrun (Gloo and MPI): every
other rank raises ``RanksStalled`` within the stall timeout plus a margin, naming the gradient it
waits for and the stopped rank, whether the stopped rank is the one hosting the progress board
(rank 0) or not; the stall timeout comes from ``Grace(stall_timeout=...)`` or from
``GRACE_LEGACY_STALL_TIMEOUT``. The job is then killed and no process of it is left."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.distributed.launcher import WORKERS, WorkerFailure, start

pytestmark = pytest.mark.distributed

STALL_TIMEOUT_S = 3.0
#: What the error may take beyond the timeout: the board's listening time (2.5 s), a read of a
#: stopped host (10 s) and a loaded machine's scheduling.
MARGIN_S = 25.0
#: Start-up, two steps and the stall, on a loaded 2-core machine.
JOB_BOUND_S = 240.0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_job(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.parametrize(("controller", "np", "victim", "timeout_from"),
                         [("gloo", 3, 1, "argument"), ("mpi", 2, 0, "environment")])
def test_a_stopped_rank_is_named_by_every_other_rank(controller, np, victim, timeout_from, tmp_path):
    args = ["--victim", str(victim)]
    env = {}
    if timeout_from == "argument":
        args += ["--stall-timeout", str(STALL_TIMEOUT_S)]
    else:
        env["GRACE_LEGACY_STALL_TIMEOUT"] = str(STALL_TIMEOUT_S)
    log = open(tmp_path / "output.txt", "w")
    proc = start(WORKERS / "stall_worker.py", np, controller, "--out", str(tmp_path), *args, extra_env=env,
                 stdout=log, stderr=log)
    others = [r for r in range(np) if r != victim]
    started = time.monotonic()
    try:
        while not all((tmp_path / f"rank{r}.json").exists() for r in others):
            if time.monotonic() - started > JOB_BOUND_S:
                raise WorkerFailure(f"no stall error from every rank in {JOB_BOUND_S} s\n"
                                    f"{(tmp_path / 'output.txt').read_text()[-6000:]}")
            if proc.poll() is not None and not (tmp_path / "stopped.json").exists():
                raise WorkerFailure((tmp_path / "output.txt").read_text()[-6000:])
            time.sleep(0.2)
        time.sleep(0.5)  # let each rank's os._exit finish
    finally:
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(np) if (tmp_path / f"pid{r}").exists()]
        kill_job(proc, pids)
        log.close()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pids) == np and not [pid for pid in pids if alive(pid)], "a process of the job is left"

    stopped_at = json.loads((tmp_path / "stopped.json").read_text())["time"]
    for rank in others:
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        after = report["raised_at"] - stopped_at
        print(f"{controller}: rank {rank} raised {after:.1f} s after rank {victim} stopped: {report['message']}")
        assert report["step"] == 2 and report["timeout_s"] == STALL_TIMEOUT_S
        assert STALL_TIMEOUT_S - 0.5 <= after <= STALL_TIMEOUT_S + MARGIN_S, after
        assert report["stalled"] == [victim], report["message"]
        assert f"waits for rank {victim}" in report["message"], report["message"]
        assert report["tensors"] and set(report["tensors"]) <= set(report["parameters"]), report["tensors"]
        assert f"the gradient of {report['tensors'][0]!r}" in report["message"], report["message"]
