"""Elastic training with LEGACY-scheduled Top-k and error feedback under real elastic ``horovodrun``
(Gloo; ``localhost`` and ``127.0.0.1`` are two hosts, listed by a discovery script that prints a
file the run rewrites): a worker raising mid-step, a worker killed mid-step, and hosts added then
removed then added again.

Each world the job passes through (from one reset to the next) is read back from the records
every process writes (``elastic_worker.py``), and each run must show: every rank of a
world holds bit-identical parameters after every step; a world continues from the step its
predecessor last committed; a survivor continues with the residuals it had at that commit and a
newcomer with none; compression stays on (each step sends less than dense) in every world; and
the job ends with every rank at the last step with the same parameters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import HOROVODRUN, WORKERS, run_command

pytestmark = pytest.mark.distributed

STEPS = 20
COMMIT_EVERY = 4
FAIL_AT = 6  # a step after the commit at 4, so its world loses a step it must redo
TIMEOUT_S = 420


def elastic_run(tmp_path: Path, hosts: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``horovodrun -np 2 --min-np 1 --max-np 3`` with a discovery script that prints
    ``tmp_path/hosts`` (first holding ``hosts``); returns the run and every record, in order per
    process."""
    hosts_file, script = tmp_path / "hosts", tmp_path / "discover.sh"
    hosts_file.write_text(hosts.replace(";", "\n") + "\n")
    script.write_text(f"#!/bin/sh\ncat '{hosts_file}'\n")
    script.chmod(0o755)
    # --network-interface: otherwise an elastic job waits for two hosts to compare interfaces.
    cmd = [str(HOROVODRUN), "-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script", str(script),
           "--network-interface", "lo", "--gloo", sys.executable, str(WORKERS / "elastic_worker.py"),
           "--out", str(tmp_path), "--hosts-file", str(hosts_file), "--steps", str(STEPS),
           "--commit-every", str(COMMIT_EVERY), "--fail-at", str(FAIL_AT), *args]
    result = run_command(cmd, TIMEOUT_S, extra_env={"HOROVOD_ELASTIC_TIMEOUT": "180"})
    records = [json.loads(line) for path in sorted(tmp_path.glob("records-*.jsonl"))
               for line in path.read_text().splitlines()]
    return result, records


def worlds(records: list[dict]) -> list[dict]:
    """The job's worlds in order: for each, its size, entering step, and each process's records."""
    found: dict[tuple[int, int], dict] = {}
    current: dict[int, tuple[int, int]] = {}
    for r in records:
        if r["event"] == "enter":
            current[r["pid"]] = key = (r["step"], r["size"])
            found.setdefault(key, {"step": r["step"], "size": r["size"], "by_pid": {}})
        found[current[r["pid"]]]["by_pid"].setdefault(r["pid"], []).append(r)
    return sorted(found.values(), key=lambda w: w["step"])


def check_run(result: subprocess.CompletedProcess, records: list[dict], sizes: list[int]) -> list[dict]:
    """Everything every scenario must show (see the module docstring); returns the worlds."""
    log = result.stdout[-6000:]
    assert result.returncode == 0, log
    found = worlds(records)
    assert [w["size"] for w in found] == sizes, f"{[(w['step'], w['size']) for w in found]}\n{log}"
    for world in found:
        enters = [rs[0] for rs in world["by_pid"].values()]
        assert sorted(e["rank"] for e in enters) == list(range(world["size"])), enters
        steps: dict[int, set[str]] = {}
        for rs in world["by_pid"].values():
            for r in rs:
                if r["event"] == "step":
                    steps.setdefault(r["step"], set()).add(r["digest"])
                    assert 0 < r["sent"] < r["dense"], r  # compression on, in every world
        assert steps and all(len(d) == 1 for d in steps.values()), f"ranks' parameters differ: {steps}"
    for before, after in zip(found, found[1:], strict=False):
        commits = {pid: [r for r in rs if r["event"] == "commit"] for pid, rs in before["by_pid"].items()}
        last_commit = max(c[-1]["step"] for c in commits.values() if c)
        assert after["step"] == last_commit, (before["step"], after["step"], last_commit)
        for pid, rs in after["by_pid"].items():
            entered = rs[0]
            if pid in commits:  # a survivor continues with its residuals of that commit
                assert entered["residual"] == commits[pid][-1]["residual"] > 0, (entered, commits[pid][-1])
            else:  # a newcomer starts without
                assert entered["residual"] == 0.0, entered
    done = [r for r in records if r["event"] == "done"]
    assert len(done) == sizes[-1] and {r["step"] for r in done} == {STEPS}, done
    assert len({r["digest"] for r in done}) == 1, done
    assert all(r["volume"] < 1 for r in done), done
    return found


@pytest.mark.parametrize(("scenario", "hosts", "fail_host", "given"), [
    ("raise", "localhost:2;127.0.0.1:1", "127.0.0.1", []),
    # The bare schedule as compression: the optimizer's bundle (and its residuals) is what is saved.
    ("kill", "localhost:1;127.0.0.1:2", "localhost", ["--bare"]),
])
def test_a_worker_failing_mid_step_leaves_the_others_training_from_the_last_commit(
        tmp_path, scenario, hosts, fail_host, given):
    result, records = elastic_run(tmp_path, hosts, "--scenario", scenario, "--fail-host", fail_host, *given)
    found = check_run(result, records, sizes=[3, 2])
    first, second = found
    # The failing world went on past the commit; its survivors went back to it.
    assert max(r["step"] for rs in first["by_pid"].values() for r in rs if r["event"] == "step") == FAIL_AT - 1
    assert second["step"] == COMMIT_EVERY
    failed = [pid for pid, rs in first["by_pid"].items() if rs[0]["host"] == fail_host]
    assert len(failed) == 1 and failed[0] not in second["by_pid"]
    # A failing rank 0 renumbers the others: the new rank 0 was rank 1.
    old_rank = {pid: rs[0]["rank"] for pid, rs in first["by_pid"].items()}
    new_rank = {pid: rs[0]["rank"] for pid, rs in second["by_pid"].items()}
    shift = 1 if old_rank[failed[0]] == 0 else 0
    assert all(new_rank[pid] == old_rank[pid] - shift for pid in new_rank), (old_rank, new_rank)


def test_hosts_added_removed_and_added_again(tmp_path):
    """A host joins (synchronized newcomer), the first host leaves (Horovod skips synchronizing:
    the survivor notices its new rank itself), and a host joins the survivor again."""
    result, records = elastic_run(tmp_path, "localhost:2", "--scenario", "hosts",
                                  "--hosts-at", "4=localhost:2;127.0.0.1:1",
                                  "--hosts-at", "8=127.0.0.1:1",
                                  "--hosts-at", "12=127.0.0.1:1;localhost:1")
    found = check_run(result, records, sizes=[2, 3, 1, 2])
    assert [w["step"] for w in found] == [0, 4, 8, 12]
    (joined,) = set(found[1]["by_pid"]) - set(found[0]["by_pid"])
    # The newcomer of the second world, rank 2 there, is the only survivor and rank 0 of the third.
    assert found[1]["by_pid"][joined][0]["rank"] == 2
    assert list(found[2]["by_pid"]) == [joined] and found[2]["by_pid"][joined][0]["rank"] == 0
    assert found[3]["by_pid"][joined][0]["rank"] == 0
