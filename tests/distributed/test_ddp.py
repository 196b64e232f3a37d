"""The DDP communication hook (``grace_legacy.ddp``) under real ``torchrun`` with Gloo, on 2 and 4
ranks (3 and 8 for the routes): every zoo case equals its independent aggregation, bit-identical on
every rank, under each of DDP's options; ranks that disagree raise the same ``RanksDisagree``; non-finite gradients are
seen everywhere and leave no trace in the state; memory stays flat; a run resumed from
``state_dict()`` in fresh processes ends bit-identical; a killed rank ends the job within 60 s.
One launch per rank count carries most checks (see ``ddp_worker.py``)."""

import json
import os
import re
import subprocess
import time

import pytest
import torch

from tests.distributed import zoo
from tests.distributed.launcher import REPO, TORCHRUN, free_port, run_torchrun_checks, torchrun

pytestmark = pytest.mark.distributed

#: How soon after a rank is killed the whole job must have ended.
DEATH_BOUND_S = 60


def zoo_labels() -> list[str]:
    """The labels of every zoo case, to check that a worker ran each of them."""
    return [case.label for case in zoo.cases()]


@pytest.mark.parametrize("np", [2, 4])
def test_the_hook_keeps_every_guarantee(np, tmp_path):
    reports = run_torchrun_checks("ddp_worker.py", np, tmp_path, "--scenario", "checks",
                                  *(["--checkpoint"] if np == 2 else []), timeout=900)
    assert reports[0]["cases"] == zoo_labels()
    names = {check["name"] for check in reports[0]["checks"]}
    for label in reports[0]["nonfinite"]:  # each really ran through both poisoned steps
        assert f"{label}: parameters bit-identical on every rank" in names, label
        assert f"{label}: step 3: skipped, parameters untouched" in names, label
    for label in ("registration", "first step"):
        assert f"{label}: every rank raised the same message" in names
    print(f"{np} ranks: seconds per part {reports[0]['seconds']}")
    if np == 2:
        resumed = run_torchrun_checks("ddp_worker.py", np, tmp_path, "--scenario", "resume", timeout=600)
        names = {check["name"] for check in resumed[0]["checks"]}
        for label in resumed[0]["setups"]:
            assert f"{label}: resumed parameters bit-identical to the uninterrupted run's" in names, label


@pytest.mark.parametrize("np", [3, 8])
def test_the_default_keeps_each_compressor_s_own_result_at_any_rank_count(np, tmp_path):
    """The zoo's sparsifiers, LEGACY and sign compressors at 3 and 8 ranks (2 and 4 above): from 3
    ranks on the route of fewest bytes would be the two-phase one, whose result is another."""
    families = ["core", "sign"]
    reports = run_torchrun_checks("ddp_worker.py", np, tmp_path, "--scenario", "routes", "--cases", *families,
                                  timeout=900)
    assert reports[0]["cases"] == [case.label for family in families for case in zoo.cases(family)]


def test_a_killed_rank_ends_the_job_quickly(tmp_path):
    result = torchrun("ddp_worker.py", 4, tmp_path, "--scenario", "dead", timeout=300)
    ended = time.time()
    assert result.returncode != 0, result.stdout[-6000:]
    killed_at = json.loads((tmp_path / "killed_at.json").read_text())
    print(f"the job ended {ended - killed_at:.1f} s after rank 2 was killed")
    assert ended - killed_at < DEATH_BOUND_S, result.stdout[-6000:]
    assert "Signal 9" in result.stdout or "SIGKILL" in result.stdout, result.stdout[-6000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_the_hook_on_cuda_with_nccl(tmp_path):
    """The zoo's cases with CUDA gradients over NCCL, one rank per GPU (at most 4)."""
    np = min(torch.cuda.device_count(), 4)
    reports = run_torchrun_checks("ddp_worker.py", np, tmp_path, "--scenario", "cuda", timeout=900)
    assert reports[0]["cases"] == zoo_labels()


@pytest.mark.smoke
def test_the_digits_example_trains_with_the_ddp_hook(tmp_path):
    """``examples/train_digits.py --backend ddp`` under torchrun, with tiny settings, prints its line."""
    result = subprocess.run(
        [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         str(REPO / "examples" / "train_digits.py"), "--backend", "ddp", "--epochs", "2", "--legacy-by", "both",
         "--group-compressions", "100,10,1;10,1,0.5"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert re.search(r"test accuracy \d+\.\d+% \| 2 workers \(DDP\) \| rank 0 sent \d+\.\d+ MB vs \d+\.\d+ MB dense",
                     result.stdout), result.stdout[-4000:]


def test_powersgd_rounds_go_once_for_all_buckets_and_give_the_same_gradients(tmp_path):
    """``fuse_rounds`` (the default): each of PowerSGD's rounds is one allreduce for every bucket;
    ``fuse_rounds=False``: one per bucket and round; the same gradients either way."""
    reports = run_torchrun_checks("ddp_rounds_worker.py", 2, tmp_path, timeout=300)
    assert any("fused, one allreduce a round" in check["name"] for check in reports[0]["checks"])
