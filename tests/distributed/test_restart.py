"""``torchrun --max-restarts 1`` with a worker SIGKILLed mid-run, with LEGACY Top-k and error
feedback on the DDP hook (``restart_worker.py``): training resumes from the last checkpoint (model,
optimizer, and each rank's ``GraceState.state_dict()``) and ends bit-identical to an uninterrupted
run: the restarted workers run again the steps since the checkpoint from the same parameters,
optimizer state, compression state (residuals, step counters, byte counts) and data, over the same
world size, so every collective sees the same inputs in the same order. A control resumed without
the compression state must end elsewhere, which shows the comparison would notice a state that was
not restored.

The kill is drawn from a seed, drawn at random and printed: ``GRACE_FAULT_SEED=<seed>`` replays a
run, ``GRACE_FAULT_RUNS=<n>`` runs ``n`` seeds in a row (seed, seed + 1, ...).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from tests.distributed.launcher import TORCHRUN, WORKERS, run_command
from tests.helpers import fault_seed, free_port

pytestmark = pytest.mark.distributed

SEED = fault_seed()
RUNS = int(os.environ.get("GRACE_FAULT_RUNS", "1"))
TIMEOUT_S = 600


def records_of(directory: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("records-*.jsonl"))
            for line in path.read_text().splitlines()]


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
