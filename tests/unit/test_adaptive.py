"""What the three adaptive schedules (DGC's warm-up, Accordion, L-GreCo) share with each other and
with LEGACY (``schedules/base.py``): a state that continues the same decisions, a repr that names
the configuration and the decisions, argument checks that name the argument, any parameter
(density, levels, rank), and any memory through ``Grace`` with every rank deciding alike. Each
schedule's own rule is in its file (``test_dgc_warmup.py``, ``test_accordion.py``,
``test_lgreco.py``), whose inputs are used here."""

import math

import pytest
import torch

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
    RandomK,
    Residual,
    Threshold,
    TopK,
)
from tests.helpers import run_ranks
from tests.unit.test_accordion import A, B, make_accordion, spike
from tests.unit.test_lgreco import CHOICES, layer_gradients


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
def test_every_schedule_sets_any_parameter(make_base, values, warmup):
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
