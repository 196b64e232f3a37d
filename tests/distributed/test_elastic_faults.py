"""Real faults at random points under real elastic ``horovodrun``, with LEGACY Top-k and error
feedback kept in ``hvd.elastic.TorchState``.

Elastic ``horovodrun`` (Gloo: Horovod's elastic mode runs on Gloo only) with a discovery script
listing two hosts (``localhost`` and ``127.0.0.1``, two slots each): one of the four processes,
drawn with the step, the point of that step and the way it fails (SIGKILL or an exception) from a
seed (``elastic_faults_worker.py``), fails. Horovod blacklists its host, so two ranks go on. The job
must recover from the commit before the faulty step (or the one right after it), finish every
step, end with both final ranks' parameters bit-identical (and all ranks' identical at the end of
every epoch, checked by the worker), and compress throughout (volume < 1, some tensors on a
compressed route).

The fault is drawn from a seed, drawn at random and printed: ``GRACE_FAULT_SEED=<seed>`` replays a
run, ``GRACE_FAULT_RUNS=<n>`` runs ``n`` seeds in a row (seed, seed + 1, ...), each run after the
seeds of :data:`REGRESSIONS` unless a seed is given. The campaign's figures:
docs/GUARANTEES.md#faults.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.launcher import HOROVODRUN, WORKERS, run_command
from tests.helpers import fault_seed

pytestmark = pytest.mark.distributed

#: The hosts the discovery script lists: two, with two slots each. A failing process takes its
#: host's other process with it (Horovod blacklists the host), so every run goes on with two ranks.
HOSTS = "localhost:2\n127.0.0.1:2"
#: Faults that found a bug, run every time, with their hosts. 208087714 (three processes): a
#: 3-rank world (scatter-gather routes) fails at a launch, leaving an all-to-all never waited for;
#: the next world's first allgather got the same Horovod handle number and was read as an
#: all-to-all (fixed in backends/horovod.py).
REGRESSIONS = {208087714: "localhost:2\n127.0.0.1:1"}
SEED = fault_seed()
RUNS = int(os.environ.get("GRACE_FAULT_RUNS", "1"))
CASES = [*(pytest.param(seed, hosts, id=f"regression-{seed}") for seed, hosts in REGRESSIONS.items()
           if "GRACE_FAULT_SEED" not in os.environ),
         *(pytest.param(SEED + run, HOSTS, id=str(SEED + run)) for run in range(RUNS))]

EPOCHS, BATCHES, COMMIT_EVERY = 2, 6, 3
TIMEOUT_S = 600


def records_of(directory: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("records-*.jsonl"))
            for line in path.read_text().splitlines()]


@pytest.mark.parametrize(("seed", "hosts"), CASES)
def test_elastic_horovodrun_recovers_from_a_random_fault(seed, hosts, tmp_path):
    slots = {host: int(n) for host, n in (line.split(":") for line in hosts.splitlines())}
    processes = sum(slots.values())
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nprintf '{hosts}\\n'\n")
    script.chmod(0o755)
    cmd = [str(HOROVODRUN), "-np", str(processes), "--min-np", "1", "--max-np", str(processes),
           "--host-discovery-script", str(script), "--network-interface", "lo", sys.executable,
           str(WORKERS / "elastic_faults_worker.py"), "--epochs", str(EPOCHS), "--batches-per-epoch", str(BATCHES),
           "--batches-per-commit", str(COMMIT_EVERY), "--fault", str(seed), "--processes", str(processes),
           "--records", str(tmp_path)]
    started = time.monotonic()
    result = run_command(cmd, TIMEOUT_S, extra_env={"HOROVOD_ELASTIC_TIMEOUT": "300"})
    elapsed = time.monotonic() - started
    records = records_of(tmp_path)
    replay = (f"replay: pytest tests/distributed/{Path(__file__).name} -k regression-{seed}" if seed in REGRESSIONS
              else f"replay: GRACE_FAULT_SEED={seed} pytest tests/distributed/{Path(__file__).name}")
    log = f"{replay}\n{result.stdout[-6000:]}"
    assert result.returncode == 0, log
    faults = [r for r in records if r["event"] == "fault"]
    assert len(faults) == 1, f"{faults}\n{log}"
    (fault,) = faults
    drawn = fault["fault"]
    assert fault["start_rank"] == drawn["victim"], log
    enters = [r for r in records if r["event"] == "enter"]
    assert len({(r["size"], r["step"]) for r in enters}) >= 2, f"no reset: {enters}\n{log}"
    # The world after the fault starts from a commit: the last one before the faulty step, or the
    # one right after it (the others finished the step and saved before their commit's broadcast
    # failed); for a fault inside a commit, the first commit after the faulty step.
    step = drawn["step"]
    after = sorted((r for r in enters if r["time"] > fault["time"]), key=lambda r: r["time"])
    latest = -(-(step + 1) // COMMIT_EVERY) * COMMIT_EVERY if drawn["point"] == "commit" else step + 1
    assert after and step // COMMIT_EVERY * COMMIT_EVERY <= after[0]["step"] <= latest, f"{after}\n{log}"
    assert all(r["step"] % COMMIT_EVERY == 0 for r in enters), f"{enters}\n{log}"
    done = [r for r in records if r["event"] == "done"]
    assert all(r["pid"] != fault["pid"] for r in done), f"the failed process went on: {done}\n{log}"
    assert done and len(done) == done[0]["size"], f"{done}\n{log}"
    # The failing process's host left, and only it.
    assert len(done) == processes - slots[fault["host"]], f"{done}\n{log}"
    assert {r["step"] for r in done} == {EPOCHS * BATCHES}, f"{done}\n{log}"
    assert len({r["digest"] for r in done}) == 1, f"final ranks differ: {done}\n{log}"
    for r in done:
        assert r["volume"] < 1 and set(r["routes"]) - {"dense", "dense-fallback"}, f"compression off: {r}\n{log}"
    where = f"{fault['where']} ({fault['route'] or 'step'})"
    print(f"seed {seed}: hosts {hosts.replace(chr(10), ',')}; start rank {drawn['victim']} ({fault['host']}) "
          f"{drawn['mode']} at step {drawn['step']}, {where}; recovered, {len(done)} ranks at the end, "
          f"{len(enters)} entries, {elapsed:.0f} s")
