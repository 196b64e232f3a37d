"""Budget matching (``schedules/budget.py``): ``Legacy.budget_matched`` scales a schedule's shape
(layer and phase factors) so that it spends the uniform target's bytes over the run, within 1%,
on a model's sizes or named parameters; an impossible shape is refused."""

import pytest
import torch

from grace_legacy import Legacy, TopK
from grace_legacy.runtime.cost import bytes_sent

MODEL_SIZES = [64, 576, 64, 36_864, 64, 73_728, 128, 147_456, 128, 8_192, 128, 2_359_296, 512, 5_130, 10]


@pytest.mark.parametrize("by,kwargs", [
    ("layer", dict(splits=[10_000], layer_factors=[10, 1])),
    ("epoch", dict(phase_factors=[2, 1, 0.5], epochs=90)),
    ("both", dict(splits=[10_000, 1_000_000], layer_factors=[10, 3, 1], phase_factors=[2, 1, 0.5], epochs=90)),
    ("epoch", dict(phase_factors=[4, 1], boundaries=[10], epochs=90)),
])
@pytest.mark.parametrize("target", [0.001, 0.01])
def test_budget_matched_schedule_spends_the_uniform_budget(by, kwargs, target):
    schedule = Legacy.budget_matched(TopK(), target, by=by, sizes=MODEL_SIZES, **kwargs)
    uniform = sum(bytes_sent(TopK(target), n, torch.float32) for n in MODEL_SIZES)
    spent = sum(w * bytes_sent(schedule.configured_at(p, schedule.group_of(n)), n, torch.float32)
                for p, w in enumerate(schedule.phase_weights()) for n in MODEL_SIZES)
    assert abs(spent - uniform) / uniform < 0.01
    # The shape is kept: where nothing is clipped, ratios between groups are the factors.
    if by == "layer":
        assert schedule.table[0][0] == pytest.approx(10 * schedule.table[0][1])


def test_budget_matched_accepts_named_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.Linear(200, 10))
    schedule = Legacy.budget_matched(TopK(), 0.01, by="layer", sizes=model.named_parameters(), splits=[1000],
                                     layer_factors=[5, 1])
    assert schedule.by == "layer" and schedule.table[0][0] > schedule.table[0][1]


def test_budget_matched_refuses_an_impossible_shape():
    with pytest.raises(ValueError, match="no scale"):
        Legacy.budget_matched(TopK(), 0.9, by="layer", sizes=[10, 10**6], splits=[100], layer_factors=[1, 1000])
