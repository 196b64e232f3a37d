"""DGC's warm-up (``schedules/dgc_warmup.py``): the paper's sequence at every epoch, the default
coefficient from the reference formula, changes exactly at epoch boundaries when steps are
counted, integer and increasing parameters (QSGD levels, PowerSGD ranks, a growing threshold),
and bytes broken down by phase."""

import itertools
import math

import pytest
import torch

from grace_legacy import QSGD, DGCWarmup, Grace, PowerSGD, Threshold, TopK

PAPER = [0.25, 0.0625, 0.015625, 0.00390625, 0.001]


@pytest.mark.parametrize("epoch", range(8))
def test_dgc_paper_sequence_at_every_epoch(epoch):
    schedule = DGCWarmup(TopK(), target=0.001, warmup_epochs=4, coeff=0.25)
    schedule.set_epoch(epoch)
    expected = PAPER[min(epoch, 4)]
    assert schedule.value_at(epoch) == expected
    assert schedule.compressor_for(torch.zeros(1000), "w").ratio == expected
    assert schedule.stats["warmup"]["current"] == expected


def test_dgc_default_coefficient_is_the_reference_formula():
    # max(target ** ((e + 1) / (W + 1)), target) for e < W, then target.
    schedule = DGCWarmup(TopK(), target=0.001, warmup_epochs=4)
    assert schedule.values[:4] == pytest.approx([0.001 ** ((e + 1) / 5) for e in range(4)], rel=1e-12)
    assert schedule.values[4] == 0.001
    assert all(a > b for a, b in itertools.pairwise(schedule.values))


@pytest.mark.parametrize("steps_per_epoch", [1, 3, 7])
def test_dgc_counted_steps_change_exactly_at_epoch_boundaries(steps_per_epoch):
    schedule = DGCWarmup(TopK(), target=0.001, warmup_epochs=4, coeff=0.25, steps_per_epoch=steps_per_epoch)
    seen = []
    for _ in range(6 * steps_per_epoch):
        seen.append(schedule.compressor_for(torch.zeros(100), "w").ratio)
        schedule.end_step()
    assert seen == [PAPER[min(s // steps_per_epoch, 4)] for s in range(6 * steps_per_epoch)]
    schedule.set_epoch(1)
    assert schedule.steps == steps_per_epoch and schedule.value_at(schedule.epoch) == 0.0625


def test_dgc_warmup_schedules_integer_and_increasing_parameters():
    levels = DGCWarmup(QSGD(), target=4, start=256, warmup_epochs=4)
    assert levels.values == [math.floor(256 * (4 / 256) ** ((e + 1) / 5) + 0.5) for e in range(4)] + [4]
    ranks = DGCWarmup(PowerSGD(), target=1, start=8, warmup_epochs=2, coeff=0.5)
    assert ranks.values == [4, 2, 1]
    growing = DGCWarmup(Threshold(), target=0.1, start=0.001, warmup_epochs=1)
    assert growing.values == pytest.approx([0.01, 0.1])
    assert DGCWarmup(TopK(), target=0.01, warmup_epochs=0).values == [0.01]


def test_dgc_stats_break_bytes_down_by_phase():
    schedule = DGCWarmup(TopK(), target=0.001, warmup_epochs=2, coeff=0.25)
    bundle = Grace(schedule)
    for epoch in range(4):
        schedule.set_epoch(epoch)
        bundle.record_traffic("w", torch.zeros(1000), 10 * (epoch + 1), "allgather")
    stats = bundle.stats
    assert schedule.stats == {"warmup": stats["warmup"]}  # the schedule's own decisions, no traffic
    assert {p: stats["phase"][p]["bytes_sent"] for p in stats["phase"]} == {0: 10, 1: 20, 2: 70}
    assert stats["warmup"] == {"values": [0.25, 0.0625, 0.001], "epoch": 3, "phase": 2, "current": 0.001}
