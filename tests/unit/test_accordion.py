"""Accordion (``schedules/accordion.py``): regime switches at the exact steps of a synthetic
sequence of aggregated gradients worked out by hand from the rule (learning-rate drops and an
undone observation included), a ratio at ``eta`` critical and just below not, the regimes'
breakdown in stats, and non-finite observations and scale ignored."""

import math

import torch

from grace_legacy import Accordion, Grace, TopK


def spike(x):
    return torch.tensor([x, 0.0, 0.0, 0.0])


# Two gradients per interval (interval=2) for each tensor; the sums' norms, and so the ratios, are
# exact in binary. a: 10, 10, 4, 3, 3, 6, 6, 6 -> ratios 0, .6, .25, 0, 1, 0, 0.
# b: 10, 2, 1, 1.5, 1.5, 1.5 (a NaN ignored), 1.5 (an observation rolled back), 1.5 -> ratios .8, .5 (== eta),
# .5 (growth, == eta), 0, 0, 0, 0.
A = [5, 5, 5, 5, 2, 2, 1.5, 1.5, 1.5, 1.5, 3, 3, 3, 3, 3, 3]
B = [5, 5, 1, 1, 0.5, 0.5, 0.75, 0.75, 0.75, 0.75, math.nan, 1.5, 100, 1.5, 0.75, 0.75]
LOW, HIGH = 0.5, 0.1
# Worked out by hand from the rule (see Accordion's docstring): intervals 0 and 1 are critical;
# the learning rate drops between intervals at step 8 (critical through step 9) and in the middle
# of interval 5, after step 10 (critical for step 11 only).
EXPECTED_A = [LOW] * 4 + [HIGH] * 2 + [LOW] * 2 + [LOW] * 2 + [HIGH, LOW] + [LOW] * 2 + [HIGH] * 2
EXPECTED_B = [LOW] * 4 + [LOW] * 2 + [LOW] * 2 + [LOW] * 2 + [HIGH, LOW] + [HIGH] * 2 + [HIGH] * 2


def drive_accordion(schedule, steps=range(16)):
    seen = {"a": [], "b": []}
    for step in steps:
        for name, values in (("a", A), ("b", B)):
            seen[name].append(schedule.compressor_for(torch.zeros(1000), name).ratio)
            schedule.observe(name, spike(values[step]))
        if step == 12:
            schedule.undo("b")  # a skipped step: its observation must leave no trace
        schedule.end_step()
        if step == 7:
            schedule.notify_lr_drop()
        if step == 10:
            schedule.set_lr(0.01)
    return seen


def make_accordion():
    schedule = Accordion(TopK(), low=LOW, high=HIGH, eta=0.5, interval=2)
    schedule.set_lr(0.1)
    schedule.set_lr(0.1)  # not a drop
    return schedule


def test_accordion_switches_regimes_at_the_exact_steps():
    schedule = make_accordion()
    seen = drive_accordion(schedule)
    assert seen["a"] == EXPECTED_A
    assert seen["b"] == EXPECTED_B
    stats = schedule.stats["accordion"]
    assert stats["history"]["a"] == [[0, LOW], [4, HIGH], [6, LOW], [10, HIGH], [11, LOW], [14, HIGH]]
    assert stats["history"]["b"] == [[0, LOW], [10, HIGH], [11, LOW], [12, HIGH]]
    assert stats["lr_drops"] == [8, 11] and stats["intervals"] == 8
    assert stats["ratios"] == {"a": 0.0, "b": 0.0}


def test_accordion_ratio_at_eta_is_critical_and_just_below_is_not():
    for second, critical in ((1.0, True), (1.0 + 2**-20, False)):
        schedule = Accordion(TopK(), low=LOW, high=HIGH, eta=0.5, interval=1)
        for x in (2.0, 2.0, second):  # intervals 0, 1 (vs 0: ratio 0), 2 (vs 1: (2 - second) / 2)
            schedule.observe("w", spike(x))
            schedule.end_step()
        assert schedule.value_of("w") == (LOW if critical else HIGH)


def test_accordion_regime_breakdown_in_stats():
    schedule = make_accordion()
    bundle = Grace(schedule)
    for step in range(16):
        for name, values in (("a", A), ("b", B)):
            bundle.record_traffic(name, torch.zeros(10), 40 if schedule.value_of(name) == LOW else 8, "allgather")
            schedule.observe(name, spike(values[step]))
        if step == 12:
            schedule.undo("b")
        schedule.end_step()
        if step == 7:
            schedule.notify_lr_drop()
        if step == 10:
            schedule.set_lr(0.01)
    regimes = bundle.stats["regime"]
    # a at steps 8, 9 and 11 and b at step 11 are critical only because of the drops.
    assert regimes["lr-drop"]["tensors"] == 4
    assert regimes["normal"]["tensors"] == EXPECTED_A.count(HIGH) + EXPECTED_B.count(HIGH)
    assert regimes["critical"]["tensors"] == 32 - 4 - regimes["normal"]["tensors"]


def test_accordion_ignores_non_finite_observations_and_scale():
    plain = Accordion(TopK(), low=LOW, high=HIGH, interval=1)
    scaled = Accordion(TopK(), low=LOW, high=HIGH, interval=1)
    for x in (3.0, 2.0, 1.9, 1.0):
        plain.observe("w", spike(x))
        scaled.observe("w", spike(1000 * x))
        scaled.observe("w", spike(math.inf))
        plain.end_step()
        scaled.end_step()
        assert plain.value_of("w") == scaled.value_of("w")
    assert plain.stats["accordion"]["history"] == scaled.stats["accordion"]["history"]
