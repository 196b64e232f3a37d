"""The adaptive schedules: DGC's warm-up sequence, Accordion's regime switches on a synthetic
sequence of aggregated gradients, L-GreCo's dynamic program against brute force, and what all
three share with Legacy (state, validation, memories, parameters, rank agreement)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import (
    DGC,
    EF21,
    FP16,
    QSGD,
    Accordion,
    DGCMemory,
    DGCWarmup,
    Grace,
    LGreCo,
    NoMemory,
    PowerSGD,
    PowerSGDMemory,
    RandomK,
    Residual,
    Threshold,
    TopK,
)
from grace_legacy.schedules.lgreco import choose_layerwise
from tests.helpers import run_ranks

# -- DGC warm-up -----------------------------------------------------------------------------------

PAPER = [0.25, 0.0625, 0.015625, 0.00390625, 0.001]


@pytest.mark.parametrize("epoch", range(8))
def test_dgc_paper_sequence_at_every_epoch(epoch):
    schedule = DGCWarmup(TopK(), target=0.001, warmup_epochs=4, coeff=0.25)
    schedule.set_epoch(epoch)
    expected = PAPER[min(epoch, 4)]
    assert schedule.knob_at(epoch) == expected
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
    assert schedule.steps == steps_per_epoch and schedule.knob_at(schedule.epoch) == 0.0625


def test_dgc_warmup_schedules_integer_and_increasing_knobs():
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
    stats = schedule.stats
    assert {p: stats["phase"][p]["bytes_sent"] for p in stats["phase"]} == {0: 10, 1: 20, 2: 70}
    assert stats["warmup"] == {"values": [0.25, 0.0625, 0.001], "epoch": 3, "phase": 2, "current": 0.001}


# -- Accordion -------------------------------------------------------------------------------------


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
    regimes = schedule.stats["regime"]
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


# -- L-GreCo: the dynamic program ----------------------------------------------------------------


def brute_force(errors, sizes, budget, *, with_error=False):
    """The smallest total size over every assignment with total error <= budget (None if none);
    ``with_error``: (size, the smallest total error among assignments of that size)."""
    best = None
    for assignment in itertools.product(*[range(len(row)) for row in errors]):
        error = math.fsum(errors[i][c] for i, c in enumerate(assignment))
        if error <= budget:
            key = (sum(sizes[i][c] for i, c in enumerate(assignment)), error)
            best = key if best is None else min(best, key)
    return best if best is None or with_error else best[0]


def total(rows, assignment):
    return math.fsum(rows[i][c] for i, c in enumerate(assignment))


instances = st.integers(1, 4).flatmap(lambda layers: st.integers(1, 4).flatmap(lambda choices: st.tuples(
    st.lists(st.lists(st.integers(0, 20), min_size=choices, max_size=choices), min_size=layers, max_size=layers),
    st.lists(st.lists(st.integers(0, 50), min_size=choices, max_size=choices), min_size=layers, max_size=layers))))


@given(instance=instances, budget=st.integers(0, 60))
@settings(max_examples=300, deadline=None)
def test_dp_is_exact_when_errors_are_whole_buckets(instance, budget):
    # resolution = budget makes a bucket 1 wide: integer errors are not rounded at all.
    errors, sizes = instance
    optimum = brute_force(errors, sizes, budget, with_error=True)
    chosen = choose_layerwise(errors, sizes, budget, resolution=max(budget, 1))
    if optimum is None:
        assert chosen is None
    else:
        assert chosen is not None and total(errors, chosen) <= budget
        # The fewest bytes, and among those the smallest error.
        assert (total(sizes, chosen), total(errors, chosen)) == optimum


float_instances = st.integers(1, 4).flatmap(lambda layers: st.integers(1, 4).flatmap(lambda choices: st.tuples(
    st.lists(st.lists(st.floats(0, 1e3), min_size=choices, max_size=choices), min_size=layers, max_size=layers),
    st.lists(st.lists(st.integers(0, 10**6), min_size=choices, max_size=choices), min_size=layers,
             max_size=layers))))


@given(instance=float_instances, budget=st.floats(1e-3, 4e3), resolution=st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_dp_meets_the_budget_and_its_stated_bound(instance, budget, resolution):
    errors, sizes = instance
    layers = len(errors)
    chosen = choose_layerwise(errors, sizes, budget, resolution)
    tightened = budget * (1 - layers / resolution)
    bound = brute_force(errors, sizes, tightened) if tightened >= 0 else None
    if chosen is None:
        assert bound is None
        return
    assert total(errors, chosen) <= budget  # the constraint holds exactly
    assert total(sizes, chosen) >= brute_force(errors, sizes, budget)
    if bound is not None:
        assert total(sizes, chosen) <= bound  # at least as small as the optimum with a tightened budget


def test_dp_small_known_answer_and_ties():
    assert choose_layerwise([[0, 1, 3], [0, 2, 5]], [[10, 5, 1], [10, 5, 1]], 4, resolution=4) == [1, 1]
    assert choose_layerwise([[0, 0]], [[3, 3]], 1.0) == [0]
    assert choose_layerwise([[0.9, 0.2, 0.5]], [[3, 3, 3]], 1.0) == [1]  # equal bytes: the smallest error
    assert choose_layerwise([[1, 0], [0, 2]], [[1, 9], [5, 1]], 0) == [1, 0]
    assert choose_layerwise([[1]], [[1]], 0) is None
    assert choose_layerwise([], [], 1.0) == []


@pytest.mark.parametrize("args,argument", [
    (([[1.0]], [[1, 2]], 1.0), "layer 0"),
    (([[1.0]], [], 1.0), "layers"),
    (([[-1.0]], [[1]], 1.0), "errors"),
    (([[math.nan]], [[1]], 1.0), "errors"),
    (([[1.0]], [[1]], -1.0), "budget"),
    (([[1.0]], [[1]], 1.0, 0), "resolution"),
])
def test_dp_rejects_bad_input(args, argument):
    with pytest.raises(ValueError, match=argument):
        choose_layerwise(*args)


# -- L-GreCo: the schedule -----------------------------------------------------------------------

CHOICES = [1.0, 0.5, 0.25, 0.1]


def layer_gradients(step: int) -> dict[str, torch.Tensor]:
    """A spiky layer (top-k loses little), a flat one (top-k loses much) and a tiny one."""
    g = torch.Generator().manual_seed(step)
    spiky = torch.randn(400, generator=g) * 0.01
    spiky[:8] += 5.0
    return {"flat": torch.randn(20, 20, generator=g), "spiky": spiky, "tiny": torch.randn(3, generator=g)}


def topk_error(g: torch.Tensor, ratio: float) -> float:
    """||g - topk(g)||^2 written out: the squares of the n - k smallest magnitudes."""
    n = g.numel()
    k = n if ratio == 1.0 else max(1, math.floor(ratio * n))
    squares = torch.sort(g.double().reshape(-1) ** 2).values
    return float(squares[: n - k].sum())


def topk_bytes(n: int, ratio: float) -> int:
    return 4 * n if ratio == 1.0 else 8 * max(1, math.floor(ratio * n))


def test_lgreco_solve_meets_the_uniform_error_with_the_fewest_bytes():
    schedule = LGreCo(TopK(), CHOICES, reference=0.25, interval=3)
    sums = {}
    for step in range(3):
        assert {schedule.choice_of(n) for n in ("flat", "spiky", "tiny")} == {0.25}  # before the first solve
        for name, g in layer_gradients(step).items():
            schedule.observe(name, g)
            sums[name] = sums.get(name, 0) + g
        schedule.end_step()
    names = sorted(sums)
    errors = [[topk_error(sums[n], c) for c in CHOICES] for n in names]
    sizes = [[topk_bytes(sums[n].numel(), c) for c in CHOICES] for n in names]
    budget = math.fsum(row[2] for row in errors)
    chosen = [CHOICES.index(schedule.choice_of(n)) for n in names]
    assert total(errors, chosen) <= budget * (1 + 1e-9)  # independent error arithmetic, same constraint
    optimum = brute_force(errors, sizes, budget * (1 - len(names) / 1000))
    assert total(sizes, chosen) <= min(optimum, total(sizes, [2, 2, 2]))
    # The flat layer must pay for the spiky one: not uniform.
    assert schedule.choice_of("spiky") < schedule.choice_of("flat")
    solve = schedule.stats["lgreco"]["solves"][0]
    assert solve["step"] == 3 and solve["error"] <= solve["budget"] and solve["bytes"] <= solve["uniform_bytes"]
    assert solve["bytes"] == total(sizes, chosen)


def test_lgreco_takes_the_most_accurate_of_values_that_cost_the_same():
    # QSGD's levels 4, 16 and 64 all travel as int8: the same bytes, so the error decides.
    schedule = LGreCo(QSGD(seed=1), [4, 16, 64], reference=16, interval=1)
    schedule.observe("w", torch.randn(400, generator=torch.Generator().manual_seed(0)))
    schedule.end_step()
    assert schedule.choice_of("w") == 64


def test_lgreco_measures_without_moving_the_base():
    schedule = LGreCo(RandomK(seed=3), [0.5, 0.1], reference=0.1, interval=1)
    schedule.compressor_for(torch.zeros(100), "w").compress(torch.randn(100), "w")
    before = schedule.base.state_dict()
    schedule.observe("w", torch.randn(100))
    schedule.end_step()
    assert schedule.base.state_dict() == before
    assert schedule.stats["lgreco"]["overhead"]["solves"] == 1


def test_lgreco_keeps_choices_of_tensors_without_observations():
    schedule = LGreCo(TopK(), CHOICES, reference=0.25, interval=1)
    for name, g in layer_gradients(0).items():
        schedule.observe(name, g)
    schedule.end_step()
    decided = {n: schedule.choice_of(n) for n in ("flat", "spiky", "tiny")}
    schedule.observe("flat", torch.full((20, 20), math.nan))
    schedule.end_step()
    assert {n: schedule.choice_of(n) for n in decided} == decided


def test_lgreco_ranks_take_rank_0s_choices_even_when_their_own_differ():
    names = ["flat", "spiky", "tiny"]

    def body(backend):
        schedule = LGreCo(TopK(), CHOICES, reference=0.25, interval=2)
        own = None
        for step in range(2):
            grads = layer_gradients(step)
            if backend.rank() != 0:  # perturbed state: these ranks would decide otherwise
                grads["flat"], grads["spiky"] = grads["spiky"][:400].reshape(20, 20), grads["flat"].reshape(-1)
            for name in names:
                schedule.observe(name, grads[name])
            if step == 1:
                own = [schedule.choices[i] for i in schedule.solve(names)[0]]
            schedule.end_step(backend)
        return own, [schedule.choice_of(n) for n in names], schedule.stats["lgreco"]["solves"]

    results = run_ranks(3, body)
    rank0_own, rank0_applied, rank0_solves = results[0]
    assert rank0_applied == rank0_own
    for own, applied, solves in results[1:]:
        assert applied == rank0_applied and solves == rank0_solves
        assert own != rank0_applied  # the broadcast, not the local state, decided


# -- shared: state, validation, parameters, memories --------------------------------------------------


def lgreco_inputs(step):
    return layer_gradients(step)


SCHEDULES = {
    "dgc": (lambda: DGCWarmup(TopK(), target=0.01, warmup_epochs=2, steps_per_epoch=2),
            lambda step: {"w": torch.randn(50, generator=torch.Generator().manual_seed(step))}),
    "accordion": (make_accordion, lambda step: {"a": spike(A[step % 16]), "b": spike(B[step % 16])}),
    "lgreco": (lambda: LGreCo(TopK(), CHOICES, reference=0.25, interval=2), lgreco_inputs),
}


def run_steps(bundle, inputs, steps):
    schedule = bundle.compressor
    decisions = []
    for step in steps:
        grads = inputs(step)
        decisions.append({n: schedule.value_for(g, n) for n, g in grads.items()})
        for name, g in grads.items():
            bundle.record_traffic(name, g, 8, "allgather")
            schedule.observe(name, g)
        schedule.end_step()
    return decisions


def without_timing(stats):
    stats = dict(stats)
    if "lgreco" in stats:
        stats["lgreco"] = {k: v for k, v in stats["lgreco"].items() if k != "overhead"}
    return stats


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_state_dict_round_trip_continues_the_same_decisions(kind):
    make, inputs = SCHEDULES[kind]
    original = Grace(make())
    run_steps(original, inputs, range(5))
    restored = Grace(make())
    restored.load_state_dict(original.state_dict())
    assert repr(restored) == repr(original)
    assert without_timing(restored.stats) == without_timing(original.stats)
    assert run_steps(restored, inputs, range(5, 12)) == run_steps(original, inputs, range(5, 12))
    assert without_timing(restored.stats) == without_timing(original.stats)


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_repr_names_the_configuration_and_the_decisions(kind):
    make, inputs = SCHEDULES[kind]
    a, b = Grace(make()), Grace(make())
    assert repr(a) == repr(b)
    run_steps(a, inputs, range(6))
    run_steps(b, inputs, range(6))
    assert repr(a) == repr(b)
    if kind != "dgc":
        assert repr(a.compressor) != repr(make()), "the decisions should show in the description"


@pytest.mark.parametrize("make,argument", [
    (lambda: DGCWarmup(TopK(), target=None), "target"),
    (lambda: DGCWarmup(TopK(), target=1.0), "target"),
    (lambda: DGCWarmup(TopK(), target=0.0), "target"),
    (lambda: DGCWarmup(TopK(), target=1.5), "target"),
    (lambda: DGCWarmup(TopK(), target="0.1"), "target"),
    (lambda: DGCWarmup(TopK(), target=0.01, warmup_epochs=-1), "warmup_epochs"),
    (lambda: DGCWarmup(TopK(), target=0.01, warmup_epochs=2.5), "warmup_epochs"),
    (lambda: DGCWarmup(TopK(), target=0.01, coeff=1.5), "coeff"),
    (lambda: DGCWarmup(TopK(), target=0.01, coeff=0), "coeff"),
    (lambda: DGCWarmup(TopK(), target=0.01, coeff="a"), "coeff"),
    (lambda: DGCWarmup(TopK(), target=0.01, start=2.0), "start"),
    (lambda: DGCWarmup(QSGD(), target=4), "start"),
    (lambda: DGCWarmup(TopK(), target=0.01, steps_per_epoch=0), "steps_per_epoch"),
    (lambda: Accordion(TopK(), low="a", high=0.1, interval=1), "low"),
    (lambda: Accordion(TopK(), low=0.5, high=2.0, interval=1), "high"),
    (lambda: Accordion(TopK(), low=0.1, high=0.1, interval=1), "low and high"),
    (lambda: Accordion(TopK(), low=None, high=1.0, interval=1), "low and high"),
    (lambda: Accordion(TopK(), low=0.01, high=0.1, interval=1), "swap"),
    (lambda: Accordion(PowerSGD(), low=1, high=4, interval=1), "swap"),
    (lambda: Accordion(TopK(), low=0.1, high=0.01, eta=0, interval=1), "eta"),
    (lambda: Accordion(TopK(), low=0.1, high=0.01, eta=math.nan, interval=1), "eta"),
    (lambda: Accordion(TopK(), low=0.1, high=0.01, eta="x", interval=1), "eta"),
    (lambda: Accordion(TopK(), low=0.1, high=0.01, interval=0), "interval"),
    (lambda: Accordion(TopK(), low=0.1, high=0.01, interval=1.5), "interval"),
    (lambda: make_accordion().set_lr(-1.0), "lr"),
    (lambda: LGreCo(TopK(), [0.1], reference=0.1, interval=1), "choices"),
    (lambda: LGreCo(TopK(), "0.1", reference=0.1, interval=1), "choices"),
    (lambda: LGreCo(TopK(), [0.1, 0.1], reference=0.1, interval=1), "distinct"),
    (lambda: LGreCo(TopK(), [None, 1.0], reference=None, interval=1), "distinct"),
    (lambda: LGreCo(TopK(), [0.1, 2.0], reference=0.1, interval=1), r"choices\[1\]"),
    (lambda: LGreCo(TopK(), [0.1, 0.2], reference=0.3, interval=1), "reference"),
    (lambda: LGreCo(TopK(), [0.1, 0.2], reference="x", interval=1), "reference"),
    (lambda: LGreCo(TopK(), [0.1, 0.2], reference=0.1, interval=0), "interval"),
    (lambda: LGreCo(TopK(), [0.1, 0.2], reference=0.1, interval=1, budget=0), "budget"),
    (lambda: LGreCo(TopK(), [0.1, 0.2], reference=0.1, interval=1, budget=math.inf), "budget"),
    (lambda: LGreCo(TopK(), [0.1, 0.2], reference=0.1, interval=1, resolution=0), "resolution"),
    (lambda: LGreCo(Threshold(), [0.1, 0.2], reference=0.1, interval=1), "predict"),
    (lambda: DGCWarmup("topk", target=0.1), "base"),
    (lambda: Accordion(FP16(), low=0.1, high=0.01, interval=1), "no parameter"),
    (lambda: LGreCo(TopK(0.1), [0.1, 0.2], reference=0.1, interval=1), "would be ignored"),
    (lambda: DGCWarmup(DGCWarmup(TopK(), target=0.1), target=0.1), "base"),
])
def test_invalid_arguments_are_value_errors_naming_the_argument(make, argument):
    with pytest.raises(ValueError, match=argument):
        make()


KNOBS = [  # (base, two values for Accordion/L-GreCo (light first), DGCWarmup kwargs)
    (TopK, (0.5, 0.1), dict(target=0.1)),
    (RandomK, (0.5, 0.1), dict(target=0.1)),
    (lambda: DGC(min_samples=4), (0.5, 0.1), dict(target=0.1)),
    (QSGD, (64, 4), dict(target=4, start=64)),
    (PowerSGD, (4, 1), dict(target=1, start=4)),
]


def schedules_of(make_base, values, warmup):
    return [DGCWarmup(make_base(), warmup_epochs=1, **warmup),
            Accordion(make_base(), low=values[0], high=values[1], interval=1),
            LGreCo(make_base(), list(values), reference=values[1], interval=1)]


@pytest.mark.parametrize("make_base,values,warmup", KNOBS)
def test_every_schedule_sets_any_knob(make_base, values, warmup):
    parameter = make_base().parameter.name
    for schedule in schedules_of(make_base, values, warmup):
        allowed = schedule.values if isinstance(schedule, DGCWarmup) else values
        chosen = schedule.compressor_for(torch.randn(16, 12), "w")
        assert chosen.value in allowed and chosen.parameter.name == parameter, schedule
        for _ in range(3):  # through a solve and a detection
            schedule.observe("w", torch.randn(16, 12))
            schedule.end_step()
        assert schedule.compressor_for(torch.randn(16, 12), "w").value in allowed


MEMORIES = [NoMemory, Residual, EF21, DGCMemory]


@pytest.mark.parametrize("make_memory", MEMORIES)
@pytest.mark.parametrize("kind", ["dgc", "accordion", "lgreco"])
def test_runs_through_grace_with_any_memory_and_ranks_agree(kind, make_memory):
    def build():
        base = DGC(min_samples=4)
        return {"dgc": lambda: DGCWarmup(base, target=0.05, warmup_epochs=2, steps_per_epoch=1),
                "accordion": lambda: Accordion(base, low=0.5, high=0.05, eta=0.3, interval=1),
                "lgreco": lambda: LGreCo(base, [1.0, 0.5, 0.1], reference=0.1, interval=2)}[kind]()

    def body(backend):
        grace = Grace(build(), memory=make_memory())
        for step in range(5):
            for name, shape in (("w", (10, 8)), ("b", (8,))):
                g = torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + backend.rank()))
                result = grace.start(g, name, backend, average=True)()
                assert result.shape == shape and bool(torch.isfinite(result).all())
            grace.end_step(backend)
        return repr(grace.compressor), grace.stats

    results = run_ranks(2, body)
    assert results[0][0] == results[1][0]
    assert results[0][1]["tensors"] == 10


def test_powersgd_memory_and_power_sgd_knob():
    schedule = LGreCo(PowerSGD(), [4, 2, 1], reference=2, interval=1)
    grace = Grace(schedule, memory=PowerSGDMemory())
    assert isinstance(grace.memory, PowerSGDMemory)
    schedule.observe("w", torch.randn(30, 20))
    schedule.observe("b", torch.randn(20))
    schedule.end_step()
    # 1-D tensors are sent dense whatever the rank: every choice costs the same, the first wins.
    assert schedule.choice_of("b") == 4


def test_rollback_undoes_an_observation_and_reaches_the_base():
    schedule = LGreCo(PowerSGD(), [4, 1], reference=1, interval=5)
    schedule.observe("w", torch.ones(6, 4))
    schedule.end_step()
    before = schedule.state_dict()["accumulated"]
    schedule.observe("w", torch.full((6, 4), 7.0))
    concrete = schedule.compressor_for(torch.ones(6, 4), "w")
    payload, ctx = concrete.compress(torch.ones(6, 4), "w")
    payload, ctx = concrete.next_round(payload, ctx)
    concrete.end_exchange(payload, ctx)
    schedule.undo("w")
    after = schedule.state_dict()
    assert torch.equal(after["accumulated"]["sums"]["w"], before["sums"]["w"])
    assert after["accumulated"]["counts"] == before["counts"]
    assert "w" not in after["base"]["warm_q"]
