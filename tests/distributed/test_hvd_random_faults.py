"""Real faults at random points, with LEGACY Top-k and error feedback.

Elastic ``horovodrun`` (Gloo: Horovod's elastic mode runs on Gloo only) with a discovery script
listing two hosts (``localhost`` and ``127.0.0.1``, one with two slots): one process, drawn with
the step, the point of that step and the way it fails (SIGKILL or an exception) from a seed
(``workers/elastic_faults_main.py``), fails; the job must recover, finish every step, end with
every final rank's parameters bit-identical, and compress throughout (volume < 1, some tensors on a
compressed route).

``torchrun --max-restarts 1`` with a worker SIGKILLed mid-run (``workers/restart_worker.py``):
training resumes from the last checkpoint (model, optimizer, and each rank's
``GraceState.state_dict()``) and ends bit-identical to an uninterrupted run: the restarted workers
run again the steps since the checkpoint from the same parameters, optimizer state, compression
state (residuals, step counters, byte counts) and data, over the same world size, so every
collective sees the same inputs in the same order. A control resumed without the compression state
must end elsewhere, which shows the comparison would notice a state that was not restored.

Both draw from a seed, drawn at random and printed: ``GRACE_FAULT_SEED=<seed>`` replays a run,
``GRACE_FAULT_RUNS=<n>`` runs ``n`` seeds in a row (seed, seed + 1, ...) of each.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
from launcher import HOROVODRUN, TORCHRUN, WORKERS, run_command

from tests.helpers import free_port

pytestmark = pytest.mark.distributed

SEED = int(os.environ.get("GRACE_FAULT_SEED", random.SystemRandom().randrange(2**31)))
RUNS = int(os.environ.get("GRACE_FAULT_RUNS", "1"))
EPOCHS, BATCHES, COMMIT_EVERY = 2, 6, 3
PROCESSES = 3
TIMEOUT_S = 600


def records_of(directory: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("records-*.jsonl"))
            for line in path.read_text().splitlines()]


@pytest.mark.parametrize("run", range(RUNS))
def test_elastic_horovodrun_recovers_from_a_random_fault(run, tmp_path):
    seed = SEED + run
    # Which host has two slots (a failing process takes its host's other process with it).
    hosts = random.Random(f"hosts {seed}").choice(["localhost:2\n127.0.0.1:1", "localhost:1\n127.0.0.1:2"])
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nprintf '{hosts}\\n'\n")
    script.chmod(0o755)
    cmd = [str(HOROVODRUN), "-np", str(PROCESSES), "--min-np", "1", "--max-np", str(PROCESSES),
           "--host-discovery-script", str(script), "--network-interface", "lo", sys.executable,
           str(WORKERS / "elastic_faults_main.py"), "--epochs", str(EPOCHS), "--batches-per-epoch", str(BATCHES),
           "--batches-per-commit", str(COMMIT_EVERY), "--fault", str(seed), "--processes", str(PROCESSES),
           "--records", str(tmp_path)]
    started = time.monotonic()
    result = run_command(cmd, TIMEOUT_S, extra_env={"HOROVOD_ELASTIC_TIMEOUT": "300"})
    elapsed = time.monotonic() - started
    records = records_of(tmp_path)
    replay = f"replay: GRACE_FAULT_SEED={seed} pytest {Path(__file__).name} -k horovodrun"
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
    assert {r["step"] for r in done} == {EPOCHS * BATCHES}, f"{done}\n{log}"
    assert len({r["digest"] for r in done}) == 1, f"final ranks differ: {done}\n{log}"
    for r in done:
        assert r["volume"] < 1 and set(r["routes"]) - {"dense", "dense-fallback"}, f"compression off: {r}\n{log}"
    where = f"{fault['where']} ({fault['route'] or 'step'})"
    print(f"seed {seed}: hosts {hosts.replace(chr(10), ',')}; start rank {drawn['victim']} ({fault['host']}) "
          f"{drawn['mode']} at step {drawn['step']}, {where}; recovered, {len(done)} ranks at the end, "
          f"{len(enters)} entries, {elapsed:.0f} s")


def torchrun_restarting(tmp_path: Path, *args: str, restarts: int) -> list[dict]:
    tmp_path.mkdir()
    # The c10d rendezvous with the store not shared: with torch's default (a store shared by the
    # agent and its workers, with either rendezvous), restarted workers can read the previous
    # attempt's Gloo addresses and fail to connect (docs/CHECKPOINTING.md#restarts).
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--max-restarts", str(restarts), "--monitor-interval", "0.5",
           str(WORKERS / "restart_worker.py"), "--out", str(tmp_path), "--checkpoint", str(tmp_path / "checkpoint.pt"),
           *args]
    result = run_command(cmd, TIMEOUT_S, extra_env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert result.returncode == 0, result.stdout[-6000:]
    return records_of(tmp_path)


@pytest.mark.parametrize("run", range(RUNS))
def test_torchrun_restart_resumes_from_the_checkpoint_bit_identical(run, tmp_path):
    seed = SEED + run
    rng = random.Random(seed)
    steps, every = 12, 3
    point = rng.choice(["backward", "step", "checkpoint"])
    # A step after the first checkpoint; for "checkpoint", a step that ends with one.
    kill_step = rng.choice([s for s in range(every, steps) if point != "checkpoint" or (s + 1) % every == 0])
    resume_step = kill_step // every * every
    kill = ["--kill-step", str(kill_step), "--kill-rank", str(rng.randrange(2)), "--kill-point", point,
            "--kill-index", str(rng.randrange(6))]
    common = ["--steps", str(steps), "--every", str(every)]
    print(f"seed {seed}: {' '.join(kill)}")
    uninterrupted = torchrun_restarting(tmp_path / "uninterrupted", *common, "--control-from", str(resume_step),
                                        restarts=0)
    restarted = torchrun_restarting(tmp_path / "restarted", *common, *kill, restarts=1)

    reference = {r["digest"] for r in uninterrupted if r["event"] == "done"}
    assert len(reference) == 1, uninterrupted
    # Each rank restarted once, from the last checkpoint before the kill, and finished there.
    resumed = [r for r in restarted if r["event"] == "enter" and r["attempt"] == 1]
    assert sorted(r["rank"] for r in resumed) == [0, 1] and {r["step"] for r in resumed} == {resume_step}, \
        (kill, restarted)
    done = [r for r in restarted if r["event"] == "done"]
    assert sorted(r["rank"] for r in done) == [0, 1] and all(r["attempt"] == 1 for r in done), restarted
    for r in done:
        assert r["volume"] < 1 and set(r["routes"]) - {"dense", "dense-fallback"}, r
    assert {r["digest"] for r in done} == reference, (kill, restarted, uninterrupted)
    # The control, resumed from the same checkpoint without the compression state, ends elsewhere.
    control = {r["digest"] for r in uninterrupted if r["event"] == "control"}
    assert len(control) == 1 and not control & reference, uninterrupted
