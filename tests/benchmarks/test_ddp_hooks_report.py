"""The DDP hooks benchmark's bookkeeping: interleaved steps, local costs, the PowerSGD pair and the
verdicts, computed from the measurements."""

import pytest
import torch

from benchmarks.common.ddp_hooks_report import WAYS, local_costs, paired_ratio, summary
from benchmarks.common.limited_link import interleave
from benchmarks.performance.ddp_hooks import powersgd_elements


def test_interleave_rotates_the_order_and_keeps_only_the_timed_steps():
    order = []

    def step(name):
        order.append(name)
        return {"step_s": float(len(order))}

    measured = interleave({"a": (1, 2), "b": (0, 1), "c": (0, 3)}, step)
    # Iteration 1 starts at b (done: one step), iteration 2 at c.
    assert order == ["a", "b", "c", "c", "a", "c", "a"]
    assert measured["a"]["iteration"] == [1, 2] and measured["b"]["iteration"] == [0]
    assert measured["c"]["iteration"] == [0, 1, 2]
    assert measured["a"]["step_s"] == [5.0, 7.0]


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


def test_powersgd_elements_follow_the_documented_rule():
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(4, 4))
    dense, factors = powersgd_elements(model, rank=4, min_compression_rate=1)
    # Linear(100, 50): 50 x 100 factored (150 * 4); conv 8 x 27 factored ((8 + 27) * 4 = 140 < 216);
    # 4 x 4 is not ((4 + 4) * 4 >= 16); biases and the 4 x 4 weight go whole.
    assert factors == 150 * 4 + 35 * 4
    assert dense == 50 + 8 + 16 + 4
    # At 2, the conv is sent whole: 280 >= 216.
    assert powersgd_elements(model, rank=4, min_compression_rate=2) == (dense + 216, 150 * 4)
