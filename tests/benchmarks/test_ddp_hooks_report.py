"""The DDP hooks benchmark's statistics (``benchmarks/common/ddp_hooks_report.py``): local costs
paired with the compute step of the same iteration, the PowerSGD pair and the verdicts, computed
from the measurements."""

import pytest

from benchmarks.common.ddp_hooks_report import WAYS, local_costs, paired_ratio, summary


def test_local_cost_is_paired_with_the_compute_step_of_the_same_iteration():
    local = {"compute only": {"iteration": [1, 2, 3], "step_s": [1.0, 3.0, 1.0]},
             "x": {"iteration": [0, 1, 2, 3], "step_s": [9.0, 1.5, 3.5, 1.5]}}
    assert local_costs(local)["x"] == pytest.approx(0.5)
    assert paired_ratio({"iteration": [1, 2], "step_s": [2.0, 3.0]},
                        {"iteration": [0, 1, 2], "step_s": [1.0, 4.0, 2.0]}) == [0.5, 1.5]


def _result(topk_s: float, ours_s: float, ours_bytes: float) -> dict:
    steps = {"compute only": 1.0, "allreduce": 10.0, "torch fp16": 5.0, "grace FP16": 5.0,
             "torch PowerSGD": 2.0, "grace PowerSGD": ours_s, "grace Top-k + EF": topk_s}
    payload = {"grace PowerSGD": ours_bytes, "torch PowerSGD": 1000.0}
    ways = {name: {"iteration": [0, 1, 2], "step_s": [s] * 3, "wire_bytes": [0.0] * 3,
                   **{key: [payload.get(name, 1.0)] * 3 for key in ("payload_bytes",)},
                   **{key: [0.0] * 3 for key in ("backward_s", "link_bytes", "collectives")}}
            for name, s in steps.items()}
    local = {name: {"iteration": [0], "step_s": [1.0]} for name in WAYS}
    return {"models": {"resnet": {"rates": {repr(1e8): ways}, "local": local}}}


def test_the_verdicts_follow_the_measurements():
    met = summary(_result(topk_s=1.9, ours_s=1.9, ours_bytes=1004.0))
    assert all(met["verdicts"].values()) and len(met["verdicts"]) == 2
    assert met["powersgd"]["resnet"][repr(1e8)]["step_ratio"] == pytest.approx(0.95)
    slow = summary(_result(topk_s=2.1, ours_s=2.1, ours_bytes=1000.0))
    assert not any(slow["verdicts"].values())
    more_bytes = summary(_result(topk_s=1.0, ours_s=1.0, ours_bytes=1100.0))
    assert not more_bytes["powersgd"]["resnet"][repr(1e8)]["equal_bytes"]
