"""What the adaptive schedules keep of their decisions (``schedules/history.py``): Accordion's and
L-GreCo's histories are bounded and keep the latest (counts survive a state round trip), the
bound is checked, and ``history=None`` keeps everything."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import Accordion, LGreCo, TopK
from grace_legacy.schedules.history import DEFAULT_HISTORY


def alternating(step: int) -> torch.Tensor:
    """Norms 10, 10, 1, 1, 10, ...: Accordion's regime flips at almost every step (interval 1)."""
    return torch.full((10,), 1.0 if (step // 2) % 2 else 10.0)


def test_schedule_histories_are_bounded_and_keep_the_latest():
    assert Accordion(TopK(), low=0.2, high=0.02, interval=1).history == DEFAULT_HISTORY
    schedule = Accordion(TopK(), low=0.2, high=0.02, interval=1, history=3)
    for step in range(20):
        schedule.observe("w", alternating(step))
        schedule.end_step()
    assert len(schedule.stats["accordion"]["history"]["w"]) == 3
    assert schedule.stats["accordion"]["history"]["w"][-1][0] >= 18
    for _ in range(5):
        schedule.end_step()
        schedule.notify_lr_drop()
    assert schedule.stats["accordion"]["lr_drops"] == [23, 24, 25]

    lgreco = LGreCo(TopK(), [1.0, 0.1], reference=0.1, interval=1, resolution=10, history=2)
    for _ in range(6):
        lgreco.observe("w", torch.randn(50))
        lgreco.end_step()
    assert [s["step"] for s in lgreco.stats["lgreco"]["solves"]] == [5, 6]
    assert lgreco.overhead["solves"] == 6  # counted apart from the records kept
    restored = LGreCo(TopK(), [1.0, 0.1], reference=0.1, interval=1, resolution=10, history=2)
    restored.load_state_dict(lgreco.state_dict())
    assert restored.overhead["solves"] == 6 and len(restored.stats["lgreco"]["solves"]) == 2


@pytest.mark.parametrize("history,error", [(0, ValueError), (-1, ValueError), (2.5, ValueError), ("3", TypeError),
                                           (True, TypeError)])
def test_history_bound_is_checked(history, error):
    with pytest.raises(error, match="history"):
        Accordion(TopK(), low=0.2, high=0.02, interval=5, history=history)
    with pytest.raises(error, match="history"):
        LGreCo(TopK(), [1.0, 0.1], reference=0.1, interval=5, history=history)


def test_no_bound_is_allowed_when_asked_for():
    schedule = Accordion(TopK(), low=0.2, high=0.02, interval=1, history=None)
    for step in range(300):
        schedule.observe("w", alternating(step))
        schedule.end_step()
    assert len(schedule.stats["accordion"]["history"]["w"]) > DEFAULT_HISTORY
