"""Runs a worker script under a real ``horovodrun`` or ``torchrun`` and collects what each rank reported.

A test ``test_<subject>.py`` launches ``<subject>_worker.py`` beside it, as a script, with the
repository root as ``PYTHONPATH``: a worker imports what the workers share as
``tests.distributed.<module>`` (``checks``, ``harness``, ``zoo``), the library and the test
registry as any test does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
#: Where the worker scripts are: beside their tests.
WORKERS = Path(__file__).resolve().parent
HOROVODRUN = Path(sys.executable).with_name("horovodrun")
TORCHRUN = Path(sys.executable).with_name("torchrun")
CONTROLLERS = ("gloo", "mpi")


class WorkerFailure(AssertionError):
    pass


def horovodrun(script: str, np: int, controller: str, out_dir: Path, *args: str,
               timeout: float = 300, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Launch the worker ``<script>`` on ``np`` local processes; kill the whole job after ``timeout``."""
    return run_script(WORKERS / script, np, controller, "--out", str(out_dir), *args, timeout=timeout,
                      extra_env=extra_env)


def start(script: Path, np: int, controller: str, *args: str, extra_env: dict[str, str] | None = None,
          launcher_flags: tuple[str, ...] = (), **popen: object) -> subprocess.Popen:
    """Start any script on ``np`` local processes under horovodrun, in a session of its own,
    without waiting for it."""
    assert controller in CONTROLLERS
    cmd = [str(HOROVODRUN), "-np", str(np), "-H", f"localhost:{np}", f"--{controller}", *launcher_flags,
           sys.executable, str(script), *args]
    if controller == "mpi":
        # Open MPI's ranks wait by spinning; with more ranks than cores a spinning rank holds the core
        # of the rank it waits for (a 4-rank job on 2 cores took four times as long).
        extra_env = {"OMPI_MCA_mpi_yield_when_idle": "1", **(extra_env or {})}
    return _spawn(cmd, extra_env, **popen)


def run_script(script: Path, np: int, controller: str, *args: str, timeout: float = 300,
               extra_env: dict[str, str] | None = None,
               launcher_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Launch any script on ``np`` local processes (stdout and stderr merged into ``stdout``);
    kill the whole job after ``timeout``."""
    return _finish(start(script, np, controller, *args, extra_env=extra_env, launcher_flags=launcher_flags,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT), timeout)


def torchrun(script: str, np: int, out_dir: Path, *args: str, timeout: float = 300,
             extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Launch the worker ``<script>`` on ``np`` local processes under ``torchrun`` (a free port each
    time, no restarts); kill the whole job after ``timeout``."""
    cmd = [str(TORCHRUN), "--nproc-per-node", str(np), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), "--max-restarts", "0", str(WORKERS / script), "--out", str(out_dir), *args]
    return run_command(cmd, timeout, extra_env)


def run_command(cmd: list[str], timeout: float, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run any launcher command line (stdout and stderr merged into ``stdout``), the repo and the
    repository importable; kill its whole session after ``timeout``."""
    return _finish(_spawn(cmd, extra_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), timeout)


def _spawn(cmd: list[str], extra_env: dict[str, str] | None, **popen: object) -> subprocess.Popen:
    """``cmd`` in a session of its own (so the whole job can be killed), the repository importable
    (``grace_legacy``, ``tests.*``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    return subprocess.Popen(cmd, text=True, env=env, start_new_session=True, cwd=REPO, **popen)


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``proc``; kill its whole session after ``timeout``."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise WorkerFailure(f"{' '.join(proc.args)} did not finish in {timeout} s\n{output[-6000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, None)


def run_checks(script: str, np: int, controller: str, tmp_path: Path, *args: str,
               timeout: float = 300, extra_env: dict[str, str] | None = None) -> dict[int, dict]:
    """Run a worker that records named checks, and fail with every failing check's detail."""
    result = horovodrun(script, np, controller, tmp_path, *args, timeout=timeout, extra_env=extra_env)
    return reported_checks(result, script, np, tmp_path)


def run_torchrun_checks(script: str, np: int, tmp_path: Path, *args: str, timeout: float = 300,
                        extra_env: dict[str, str] | None = None) -> dict[int, dict]:
    """:func:`run_checks` under ``torchrun``."""
    result = torchrun(script, np, tmp_path, *args, timeout=timeout, extra_env=extra_env)
    return reported_checks(result, script, np, tmp_path)


def reported_checks(result: subprocess.CompletedProcess, script: str, np: int, tmp_path: Path) -> dict[int, dict]:
    """Every rank's report, failing with every failing check's detail."""
    reports = reports_of(result, script, np, tmp_path)
    failures = failed_checks(reports)
    if failures:
        raise WorkerFailure("\n".join(failures))
    return reports


def reports_of(result: subprocess.CompletedProcess, script: str, np: int, tmp_path: Path) -> dict[int, dict]:
    """Every rank's report of a job that exited 0 and recorded checks, failed ones or not: for a
    launch shared by several tests, each of which looks at its own checks (:func:`failed_checks`)."""
    if result.returncode != 0:
        raise WorkerFailure(f"{script} exited {result.returncode}\n{result.stdout[-8000:]}")
    reports = {}
    for rank in range(np):
        path = tmp_path / f"rank{rank}.json"
        if not path.exists():
            raise WorkerFailure(f"rank {rank} wrote no report\n{result.stdout[-8000:]}")
        reports[rank] = json.loads(path.read_text())
    if not any(report["checks"] for report in reports.values()):
        raise WorkerFailure(f"{script} recorded no checks")
    return reports


def failed_checks(reports: dict[int, dict], *prefixes: str) -> list[str]:
    """Each rank's failed checks (those whose names start with one of ``prefixes``, if given), with
    their details; fails if none of the checks has such a name (a test that would check nothing)."""
    chosen = [(rank, check) for rank, report in reports.items() for check in report["checks"]
              if not prefixes or check["name"].startswith(prefixes)]
    if not chosen:
        raise WorkerFailure(f"no check named {' or '.join(prefixes)}*")
    return [f"rank {rank}: {check['name']}: {check['detail']}" for rank, check in chosen if not check["ok"]]
