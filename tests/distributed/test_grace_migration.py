"""A training script written as GRACE's TRAINING.md shows (``grace_from_params`` and
``hvd.DistributedOptimizer(opt, grace=grc, named_parameters=...)``) runs under real horovodrun
once only its import line names grace_legacy instead of grace_dl: it trains, and every rank ends
with the same parameters."""

import re

import pytest

from tests.distributed.launcher import WORKERS, run_script

pytestmark = pytest.mark.distributed

FIXTURE = WORKERS / "grace_migration_worker.py"
GRACE_IMPORT = "from grace_dl.torch.helper import grace_from_params"
OUR_IMPORT = "from grace_legacy.helper import grace_from_params"


def migrated(tmp_path):
    original = FIXTURE.read_text()
    assert original.count(GRACE_IMPORT) == 1
    script = tmp_path / "train.py"
    script.write_text(original.replace(GRACE_IMPORT, OUR_IMPORT))
    changed = [(a, b) for a, b in zip(original.splitlines(), script.read_text().splitlines(), strict=True) if a != b]
    assert changed == [(GRACE_IMPORT, OUR_IMPORT)]
    return script


@pytest.mark.parametrize(("controller", "np", "params"), [
    ("mpi", 2, '{"compressor": "topk", "memory": "residual", "communicator": "allgather", "compress_ratio": 0.1}'),
    ("gloo", 4, '{"compressor": "topk", "memory": "residual", "communicator": "allgather", '
                '"legacy_by": "both", "group_compressions": "100,10;10,1", "group_splits": "1000", "epochs": 4}'),
], ids=["mpi-2-topk", "gloo-4-legacy"])
def test_grace_script_runs_after_changing_its_import_line(controller, np, params, tmp_path):
    script = migrated(tmp_path)
    result = run_script(script, np, controller, "--params", params, "--epochs", "4", timeout=400)
    output = result.stdout
    assert result.returncode == 0, output[-6000:]
    losses = [float(x) for x in re.findall(r"epoch \d+ loss ([\d.]+)", output)]
    assert len(losses) == 4, output[-4000:]
    assert losses[-1] < losses[0], losses
    checksums = set(re.findall(r"rank \d+ parameters (-?[\d.]+)", output))
    assert len(re.findall(r"rank \d+ parameters", output)) == np, output[-4000:]
    assert len(checksums) == 1, checksums
