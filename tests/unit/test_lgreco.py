"""L-GreCo (``schedules/lgreco.py``): its dynamic program against brute force (exact when errors
are whole buckets, within its stated bound otherwise, known answers and ties, bad input); and
the schedule: a solve meets the uniform error with the fewest bytes, equal bytes go to the most
accurate value, measuring leaves the base alone, tensors without observations keep their
choices, every rank takes rank 0's broadcast choices, PowerSGD's rank and memory, and an undone
observation."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import QSGD, Grace, LGreCo, PowerSGD, PowerSGDMemory, RandomK, TopK
from grace_legacy.schedules.lgreco import choose_layerwise
from tests.helpers import run_ranks

# -- the dynamic program ------------------------------------------------------------------------


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


# -- the schedule -------------------------------------------------------------------------------

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


def test_powersgd_memory_and_power_sgd_parameter():
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
