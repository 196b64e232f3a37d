"""A finished job exits 0 (issue #37): short jobs as a new user writes them
(``clean_exit_worker.py``: 20 steps, 2 ranks, Gloo, LEGACY over Top-k), each launched by a real
``torchrun`` (the DDP hook) or ``horovodrun --gloo`` (the Horovod optimizer), two jobs at a time
while a core is kept loaded (by a busy process started here, unless other work already loads the
machine), must every one exit 0 with nothing like "terminate called" in their output.

Why under load and why many jobs: the abort this guards against (a Gloo worker thread releasing a
collective that still held a Python object while the interpreter finalized:
docs/DESIGN.md#clean-exit) needs that thread to be kept off a core just when the job ends. How
often the code before the fix failed here, and the command that counts it
(``GRACE_EXIT_JOBS=<n>`` runs ``n`` jobs of each launcher): docs/GUARANTEES.md#clean-exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed.launcher import horovodrun, torchrun

pytestmark = pytest.mark.distributed

#: Jobs per launcher in the suite. The torchrun jobs are where the code before the fix aborted
#: (docs/GUARANTEES.md#clean-exit); horovodrun's never did, and two keep that path covered. Four
#: here, beside a busy core: the suite's twenty-odd other torchrun jobs (DDP, FSDP, the frameworks,
#: restarts) must each exit 0 too, most of them while the unit tests load the machine.
JOBS = {"torchrun": 4, "horovodrun": 2}
#: Jobs running at once (each has two ranks), besides the busy process.
AT_ONCE = 2
TIMEOUT_S = 180


@pytest.fixture
def busy_core():
    """A process that keeps one core busy for the length of the test, unless the machine already
    runs more than it has cores (under ``make test`` the unit tests run beside the launches): a
    busy loop added then would only take time from them."""
    if os.getloadavg()[0] >= (os.cpu_count() or 1):
        yield
        return
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    busy.kill()
    busy.wait()


def job(launcher: str, out: Path) -> subprocess.CompletedProcess:
    out.mkdir()
    if launcher == "torchrun":
        return torchrun("clean_exit_worker.py", 2, out, "--launcher", "torchrun", timeout=TIMEOUT_S)
    return horovodrun("clean_exit_worker.py", 2, "gloo", out, "--launcher", "horovodrun", timeout=TIMEOUT_S)


@pytest.mark.parametrize("launcher", ["torchrun", "horovodrun"])
def test_short_jobs_exit_cleanly_under_load(launcher, busy_core, tmp_path):
    jobs = int(os.environ.get("GRACE_EXIT_JOBS", JOBS[launcher]))
    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(job, [launcher] * jobs, [tmp_path / f"job{i}" for i in range(jobs)]))
    failed = [(i, r) for i, r in enumerate(results)
              if r.returncode != 0 or "terminate called" in r.stdout or r.stdout.count("trained 20 steps") != 2]
    print(f"{launcher}: {len(failed)} of {jobs} jobs failed")
    assert not failed, "\n".join(f"job {i} exited {r.returncode}\n{r.stdout[-4000:]}" for i, r in failed)
