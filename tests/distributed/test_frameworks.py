"""grace_legacy under Lightning's ``Trainer``, Lightning Fabric and Accelerate, each launched as its
users launch it (``python script.py`` with ``devices=2`` for Lightning, which starts the second rank
itself; ``accelerate launch --multi_gpu --num_processes 2`` for Accelerate), on CPU with Gloo.

Every run trains the same tiny model on the same batches with the same LEGACY schedule
(frameworks_common.py) and must end exactly where the plain torchrun path ends
(``DistributedDataParallel`` + ``grace_legacy.ddp.register`` by hand, plain_ddp_worker.py):
the same final parameters bit for bit on every rank, the same bytes recorded, with compression
really on (volume < 1 on every rank, both epochs' phases seen) and the hook called at every step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.frameworks_common import EPOCHS, STEPS
from tests.distributed.launcher import WORKERS, WorkerFailure, free_port, run_command, torchrun

pytestmark = pytest.mark.distributed

NP = 2
TIMEOUT = 600  # Lightning's import alone takes tens of seconds per process on a loaded 2-core machine


def reports(result: subprocess.CompletedProcess, out: Path) -> dict[int, dict]:
    if result.returncode != 0:
        raise WorkerFailure(f"{' '.join(map(str, result.args))} exited {result.returncode}\n{result.stdout[-8000:]}")
    found = {}
    for rank in range(NP):
        path = out / f"rank{rank}.pt"
        if not path.exists():
            raise WorkerFailure(f"rank {rank} wrote no report\n{result.stdout[-8000:]}")
        found[rank] = torch.load(path, weights_only=False)
    return found


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict[int, dict]:
    """The plain torchrun run every framework's run must equal."""
    out = tmp_path_factory.mktemp("plain")
    found = reports(torchrun("plain_ddp_worker.py", NP, out, timeout=TIMEOUT), out)
    check_compressed(found)
    return found


def check_compressed(found: dict[int, dict]) -> None:
    """Compression on at every step on every rank, the schedule through both epochs, ranks identical."""
    for rank, report in found.items():
        assert (report["rank"], report["world"]) == (rank, NP)
        assert report["hook_steps"] == EPOCHS * STEPS, f"rank {rank}: the hook ran {report['hook_steps']} steps"
        stats = report["stats"]
        assert 0 < stats["volume"] < 1, f"rank {rank}: volume {stats['volume']}"
        assert sorted(stats["phase"]) == [0, 1], f"rank {rank}: phases {sorted(stats['phase'])}"
        assert stats["phase"][1]["volume"] < stats["phase"][0]["volume"] < 1
        assert report["scalars"]["grace/volume"] == stats["volume"]
        assert report["scalars"]["grace/phase/1/volume"] == stats["phase"][1]["volume"]
        for name, parameter in report["parameters"].items():
            assert torch.equal(parameter, found[0]["parameters"][name]), f"rank {rank}: {name} differs from rank 0"


def check_like_plain(found: dict[int, dict], plain: dict[int, dict]) -> None:
    check_compressed(found)
    for rank in range(NP):
        assert found[rank]["stats"] == plain[rank]["stats"], f"rank {rank}: other traffic than the plain run"
        assert list(found[rank]["parameters"]) == list(plain[rank]["parameters"])
        for name, parameter in plain[rank]["parameters"].items():
            got = found[rank]["parameters"][name]
            assert torch.equal(got, parameter), \
                f"rank {rank}: {name} differs from the plain run by {(got - parameter).abs().max().item():.3e}"


def lightning_run(mode: str, out: Path) -> dict[int, dict]:
    pytest.importorskip("lightning")
    cmd = [sys.executable, str(WORKERS / "lightning_worker.py"), "--mode", mode, "--devices", str(NP),
           "--out", str(out)]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return reports(run_command(cmd, TIMEOUT, env), out)


def test_lightning_trainer_with_grace_ddp_strategy_on_cpu(plain, tmp_path):
    found = lightning_run("trainer", tmp_path)
    check_like_plain(found, plain)
    for report in found.values():
        assert report["epoch"] == EPOCHS - 1  # the strategy followed trainer.current_epoch
        assert report["strategy_scalars"] == {k.replace("grace/", "lightning/", 1): v
                                              for k, v in report["scalars"].items()}


def test_lightning_fabric_with_grace_fabric_strategy_on_cpu(plain, tmp_path):
    check_like_plain(lightning_run("fabric", tmp_path), plain)


def test_accelerate_launch_with_the_hook_on_the_prepared_model(plain, tmp_path):
    pytest.importorskip("accelerate")
    accelerate = Path(sys.executable).with_name("accelerate")
    # --multi_gpu: on a machine without GPUs this is how Accelerate starts N Gloo processes
    # (MULTI_CPU); a bare --num_processes N, or --cpu, starts one process.
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", str(NP), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
           "--main_process_port", str(free_port()), str(WORKERS / "accelerate_worker.py"), "--out", str(tmp_path)]
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}  # no user config, nothing fetched
    found = reports(run_command(cmd, TIMEOUT, env), tmp_path)
    check_like_plain(found, plain)
    assert {report["distributed_type"] for report in found.values()} == {"DistributedType.MULTI_CPU"}
