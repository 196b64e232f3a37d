"""LEGACY (``schedules/legacy.py``): the layer rule at every split, equal phases at every edge (the
reference rule exactly), explicit boundaries, counted steps and fractional progress, the
``by="both"`` table, dense values on the dense route, any parameter with its memory, argument
checks, state and stats by group and phase, the phase cache following every change of progress,
and a choice that depends on size and phase only. The reference flags are in ``test_flags.py``,
budget matching in ``test_budget.py``."""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import FP16, Grace, Legacy, NoMemory, RandomK, Residual, TopK

SPLITS = [10_000, 1_000_000]


def layer_schedule():
    return Legacy(TopK(), by="layer", values=[1.0, 0.01, 0.001], splits=SPLITS)


@pytest.mark.parametrize("numel,group", [
    (1, 0), (9_999, 0), (10_000, 1), (10_001, 1), (999_999, 1), (1_000_000, 2), (1_000_001, 2)])
def test_layer_rule_at_every_split(numel, group):
    schedule = layer_schedule()
    assert schedule.group_of(numel) == group
    assert schedule.value_at(numel) == [1.0, 0.01, 0.001][group]


@pytest.mark.parametrize("epoch,phase", [(0, 0), (29, 0), (30, 1), (31, 1), (59, 1), (60, 2), (89, 2), (90, 2),
                                         (500, 2)])
def test_equal_phases_at_every_edge(epoch, phase):
    schedule = Legacy(TopK(), by="epoch", values=[0.01, 0.005, 0.001], epochs=90)
    assert schedule.phase_of(epoch) == phase
    schedule.set_epoch(epoch)
    assert schedule.value_at(123) == [0.01, 0.005, 0.001][phase]


def test_equal_phases_follow_the_reference_rule_exactly():
    # e uses the first i with e < (i + 1) * E / P, checked against the literal formula.
    for epochs in range(1, 12):
        for phases in range(1, 6):
            schedule = Legacy(TopK(), by="epoch", values=[0.1] * phases, epochs=epochs)
            for e in range(epochs + 3):
                expected = next((i for i in range(phases) if e < (i + 1) * epochs / phases), phases - 1)
                assert schedule.phase_of(e) == expected, (epochs, phases, e)


@pytest.mark.parametrize("epoch,phase", [(0, 0), (29, 0), (30, 1), (59, 1), (60, 2), (100, 2)])
def test_explicit_boundaries(epoch, phase):
    schedule = Legacy(TopK(), by="epoch", values=[0.01, 0.005, 0.001], boundaries=[30, 60])
    assert schedule.phase_of(epoch) == phase


def test_steps_per_epoch_counts_steps_and_set_epoch_stays_compatible():
    schedule = Legacy(TopK(), by="epoch", values=[0.1, 0.01], epochs=2, steps_per_epoch=4)
    seen = []
    for _ in range(10):
        seen.append(schedule.value_at(100))
        schedule.end_step()
    assert seen == [0.1] * 4 + [0.01] * 6
    assert schedule.epoch == 2
    schedule.set_epoch(0)
    assert schedule.steps == 0 and schedule.value_at(100) == 0.1


def test_fractional_progress_with_more_phases_than_epochs():
    schedule = Legacy(TopK(), by="epoch", values=[0.3, 0.2, 0.1], epochs=1, steps_per_epoch=6)
    assert [schedule.phase_of(Fraction(s, 6)) for s in range(6)] == [0, 0, 1, 1, 2, 2]


def test_both_is_a_phase_by_group_table():
    schedule = Legacy(TopK(), by="both", values=[[1.0, 0.01], [1.0, 0.001]], splits=[10_000], epochs=90)
    assert schedule.value_at(9_999, 0) == 1.0 and schedule.value_at(10_000, 0) == 0.01
    assert schedule.value_at(9_999, 45) == 1.0 and schedule.value_at(10_000, 45) == 0.001
    assert schedule.value_at(10_000, 44) == 0.01


def test_dense_values_take_the_dense_route():
    schedule = Legacy(TopK(), by="layer", values=[None, 1.0, 0.1], splits=[10, 100])
    assert schedule.compressor_for(torch.zeros(5), "a") is None
    assert schedule.compressor_for(torch.zeros(50), "b") is None
    chosen = schedule.compressor_for(torch.zeros(500), "c")
    assert isinstance(chosen, TopK) and chosen.ratio == 0.1


def test_schedules_any_parameter_and_its_memory():
    schedule = Legacy(RandomK(seed=3), by="layer", values=[0.5, 0.1], splits=[100])
    assert schedule.traits.additive and isinstance(Grace(schedule).memory, Residual)
    assert schedule.compressor_for(torch.zeros(1000), "w").ratio == 0.1
    Grace(schedule, memory=NoMemory())


@pytest.mark.parametrize("kwargs,argument", [
    (dict(by="layer", values=[1.0, 0.1], splits=[10, 5]), "splits"),
    (dict(by="layer", values=[1.0, 0.1], splits=[10, 10]), "splits"),
    (dict(by="layer", values=[1.0, 0.1], splits=[0]), "splits"),
    (dict(by="layer", values=[1.0, 0.1], splits=[-5]), "splits"),
    (dict(by="layer", values=[1.0, 0.1, 0.01], splits=[10]), "values"),
    (dict(by="layer", values=[1.0], splits=[10]), "values"),
    (dict(by="layer", values=[1.0, 1.5], splits=[10]), r"values\[1\]"),
    (dict(by="layer", values=[0.0, 0.1], splits=[10]), r"values\[0\]"),
    (dict(by="epoch", values=[0.1, 0.01]), "epochs"),
    (dict(by="epoch", values=[0.1, 0.01], epochs=0), "epochs"),
    (dict(by="epoch", values=[0.1, 0.01], epochs=10, boundaries=[3, 5]), "boundaries"),
    (dict(by="epoch", values=[0.1, 0.01], epochs=10, boundaries=[12]), "boundaries"),
    (dict(by="epoch", values=[0.1, 0.01], epochs=10, splits=[5]), "splits"),
    (dict(by="layer", values=[0.1], epochs=10), "epochs"),
    (dict(by="both", values=[[1.0, 0.1], [1.0]], splits=[10], epochs=4), r"values\[1\]"),
    (dict(by="both", values=[0.1, 0.2], splits=[10], epochs=4), "rows"),
    (dict(by="both", values=[[1.0, 0.1], [1.0, 2.0]], splits=[10], epochs=4), r"values\[1\]\[1\]"),
    (dict(by="size", values=[0.1]), "by"),
    (dict(by="layer", values=[]), "values"),
    (dict(by="epoch", values=[0.1], epochs=3, steps_per_epoch=0), "steps_per_epoch"),
])
def test_invalid_configurations_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        Legacy(TopK(), **kwargs)


def test_invalid_base_and_types():
    with pytest.raises(TypeError, match="base"):
        Legacy("topk", by="layer", values=[0.1])
    with pytest.raises(ValueError, match="no parameter"):
        Legacy(FP16(), by="layer", values=[0.1])
    with pytest.raises(ValueError, match="would be ignored"):
        Legacy(TopK(0.1), by="layer", values=[0.1])
    with pytest.raises(TypeError, match="splits"):
        Legacy(TopK(), by="layer", values=[0.1, 0.2], splits=[1.5])
    with pytest.raises(TypeError, match="ratio"):
        Legacy(TopK(), by="layer", values=["0.1"])
    with pytest.raises(ValueError, match="epoch"):
        layer_schedule().set_epoch(-1)


def test_state_dict_restores_progress_and_stats():
    schedule = Legacy(TopK(), by="epoch", values=[0.1, 0.01], epochs=4, steps_per_epoch=3)
    bundle = Grace(schedule)
    for _ in range(7):
        schedule.end_step()
    bundle.record_traffic("w", torch.zeros(100), 80, "allgather")
    fresh = Legacy(TopK(), by="epoch", values=[0.1, 0.01], epochs=4, steps_per_epoch=3)
    resumed = Grace(fresh)
    resumed.load_state_dict(bundle.state_dict())
    assert (fresh.steps, fresh.epoch, fresh.progress) == (7, 2, Fraction(7, 3))
    assert resumed.stats == bundle.stats and resumed.stats["phase"][1]["bytes_sent"] == 80


def test_stats_break_down_by_group_and_phase():
    schedule = Legacy(TopK(), by="both", values=[[1.0, 0.1], [1.0, 0.01]], splits=[100], epochs=2)
    bundle = Grace(schedule)
    for epoch in range(2):
        schedule.set_epoch(epoch)
        bundle.record_traffic("small", torch.zeros(10), 40, "dense")
        bundle.record_traffic("large", torch.zeros(1000), 800 // (10**epoch), "allgather")
    stats = bundle.stats
    assert stats["group"][0]["volume"] == 1.0 and stats["group"][1]["bytes_sent"] == 880
    assert stats["phase"][0]["bytes_sent"] == 840 and stats["phase"][1]["bytes_sent"] == 120


@given(numel=st.integers(1, 10**8), epoch=st.integers(0, 1000))
@settings(max_examples=200, deadline=None)
def test_choice_is_a_function_of_size_and_phase_only(numel, epoch):
    a = Legacy(TopK(), by="both", values=[[1.0, 0.1, 0.01], [0.5, 0.05, 0.005]], splits=SPLITS, epochs=100)
    b = Legacy(TopK(), by="both", values=[[1.0, 0.1, 0.01], [0.5, 0.05, 0.005]], splits=SPLITS, epochs=100)
    a.set_epoch(epoch)
    b.set_epoch(epoch)
    assert a.value_at(numel) == b.value_at(numel)


@given(steps_per_epoch=st.integers(1, 7), epochs=st.integers(2, 6), phases=st.integers(2, 4),
       moves=st.lists(st.one_of(st.just("step"), st.integers(0, 8)), max_size=40))
@settings(max_examples=100, deadline=None)
def test_legacy_phase_cache_follows_every_change_of_progress(steps_per_epoch, epochs, phases, moves):
    values = [[0.5 / (p + 1), 0.1 / (p + 1)] for p in range(phases)]
    schedule = Legacy(TopK(), by="both", values=values, splits=[100], epochs=epochs, steps_per_epoch=steps_per_epoch)
    small, large = torch.zeros(10), torch.zeros(1000)
    for move in moves:
        if move == "step":
            schedule.end_step()
        else:
            schedule.set_epoch(move)
        phase = schedule.phase_of(schedule.progress)
        assert schedule.value_for(small, "s") == values[phase][0]
        assert schedule.value_for(large, "l") == values[phase][1]
        assert schedule.traffic_labels("l", large) == {"group": 1, "phase": phase}
    state = schedule.state_dict()
    fresh = Legacy(TopK(), by="both", values=values, splits=[100], epochs=epochs, steps_per_epoch=steps_per_epoch)
    fresh.value_for(small, "s")  # fill the cache at progress 0 before loading
    fresh.load_state_dict(state)
    assert fresh.current_phase() == schedule.phase_of(schedule.progress)
