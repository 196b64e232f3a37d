"""Over real horovodrun: Top-k, Random-k, FP16 and no compression through the stock
``hvd.DistributedOptimizer`` equal independent references, under Gloo and MPI, on 2 and 4 ranks."""

import pytest

from tests.distributed.launcher import CONTROLLERS, run_checks

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_synchronized_gradients_match_references(controller, np, tmp_path):
    reports = run_checks("foundation_worker.py", np, controller, tmp_path)
    names = {check["name"] for check in reports[0]["checks"]}
    # The worker must really have exercised every configuration, not skipped one.
    for label in ["topk/no-memory", "topk/sum", "topk/bpps2", "topk/residual", "randomk",
                  "fp16", "none", "hvd.Compression.none"]:
        assert any(name.startswith(f"{label}: step 2") for name in names), label
    assert "topk/bare: trains as Grace(TopK, memory=Residual())" in names
    assert any(name.startswith(f"topk/bare at {np} ranks: step 2") for name in names)
    waits = {check["name"] for check in reports[1]["checks"] if check["name"].startswith("wait:")}
    assert waits == {"wait: the late allreduce's sum", "wait: a waiting rank sleeps",
                     "wait: a failed collective raises"}
    if np == 4:
        assert any(name.startswith("topk/process-set: step 2") for name in names)
        assert any(name.startswith("topk/broadcast/process-set: step 2") for name in names)
