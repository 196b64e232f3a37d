"""Checkpoints in one process (ranks are threads, ``tests.helpers.run_ranks``): a state saved mid-run
and loaded into fresh objects continues bit for bit; it is plain data and a copy; a state saved
by another configuration, or by another rank, is refused with an error naming the difference.
The set-ups and the stepping defined here also serve ``test_grace.py`` (non-finite steps) and
``test_elastic.py``."""

from __future__ import annotations

import io

import pytest
import torch

from grace_legacy import (
    DGC,
    EF21,
    QSGD,
    Accordion,
    DGCMemory,
    DGCWarmup,
    EFSignSGD,
    Grace,
    Legacy,
    LGreCo,
    NoMemory,
    PowerSGD,
    PowerSGDMemory,
    RandomK,
    Residual,
    Signum,
    TernGrad,
    Threshold,
    TopK,
)
from tests.helpers import run_ranks

SHAPES = {"w": (12, 10), "b": (12,), "v": (30,)}
NAMES = sorted(SHAPES)

SETUPS = {
    "legacy-epoch-topk": lambda: Grace(Legacy(TopK(), by="epoch", values=[0.5, 0.2, 0.05], epochs=3,
                                              steps_per_epoch=2), memory=Residual()),
    "qsgd": lambda: Grace(QSGD(4, seed=3), dense_fallback=False),
    "terngrad": lambda: Grace(TernGrad(seed=2), dense_fallback=False),
    "randomk-residual": lambda: Grace(RandomK(0.2, seed=1), memory=Residual()),
    "powersgd": lambda: Grace(PowerSGD(2, seed=6), memory=PowerSGDMemory()),
    "dgc": lambda: Grace(DGC(0.2, seed=2, min_samples=8), memory=DGCMemory(0.9), dense_fallback=False),
    "topk-ef21": lambda: Grace(TopK(0.2), memory=EF21()),
    "signum": lambda: Grace(Signum(0.9)),
    "efsignsgd": lambda: Grace(EFSignSGD(0.1)),
    "threshold": lambda: Grace(Threshold(0.5), memory=Residual()),
    "dgc-warmup": lambda: Grace(DGCWarmup(TopK(), target=0.05, warmup_epochs=2, steps_per_epoch=1),
                                memory=DGCMemory(0.5)),
    "accordion": lambda: Grace(Accordion(TopK(), low=0.5, high=0.05, interval=2), memory=Residual()),
    "lgreco": lambda: Grace(LGreCo(TopK(), [1.0, 0.2, 0.05], reference=0.2, interval=2), memory=Residual()),
}

STEPS, RESUME_AT = 5, 2


def gradient(rank: int, step: int, name: str) -> torch.Tensor:
    seed = 1000 * step + 17 * rank + NAMES.index(name)
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed))


def step_results(bundle: Grace, backend, index: int, gradients=gradient) -> dict[str, torch.Tensor]:
    """Every tensor's synchronized gradient at step ``index``, the step not yet ended."""
    pending = {n: bundle.start(gradients(backend.rank(), index, n), n, backend, average=True) for n in NAMES}
    return {n: p() for n, p in pending.items()}


def step(bundle: Grace, backend, index: int, gradients=gradient) -> dict[str, torch.Tensor]:
    """One synchronized step as the Horovod integration runs it (without its NaN fill)."""
    out = step_results(bundle, backend, index, gradients)
    if bundle.guard.nonfinite_names(NAMES, backend):
        for n in NAMES:
            bundle.guard.undo(n)
    bundle.end_step(backend)
    return out


def differences(a, b, path: str = "") -> list[str]:
    """Where two nested states differ; tensors bit for bit, wall-clock timings ignored."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys differ"]
        return [d for k in a if k != "timing" for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [f"{path}: tensors differ"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def through_disk(state):
    """``torch.save`` then ``torch.load(weights_only=True)``: what a checkpoint file gives back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_resumed_run_continues_bit_for_bit(setup):
    def body(backend):
        uninterrupted = SETUPS[setup]()
        expected = [step(uninterrupted, backend, i) for i in range(STEPS)]
        first = SETUPS[setup]()
        for i in range(RESUME_AT):
            step(first, backend, i)
        saved = through_disk(first.state_dict())
        resumed = SETUPS[setup]()
        resumed.load_state_dict(saved)
        got = [step(resumed, backend, i) for i in range(RESUME_AT, STEPS)]
        return expected[RESUME_AT:], got, uninterrupted.state_dict(), resumed.state_dict(), uninterrupted.stats

    for expected, got, state, resumed_state, stats in run_ranks(2, body):
        for e, g in zip(expected, got, strict=True):
            assert all(torch.equal(e[n], g[n]) for n in NAMES)
        assert not differences(resumed_state, state)
        assert stats["tensors"] == STEPS * len(NAMES)


@pytest.mark.parametrize("setup", ["qsgd", "randomk-residual", "legacy-epoch-topk", "powersgd"])
def test_without_the_compression_state_a_run_ends_elsewhere(setup):
    """The control that makes the test above meaningful: the state does change the run."""
    def body(backend):
        uninterrupted = SETUPS[setup]()
        expected = [step(uninterrupted, backend, i) for i in range(STEPS)][-1]
        fresh = SETUPS[setup]()
        got = [step(fresh, backend, i) for i in range(RESUME_AT, STEPS)][-1]
        return any(not torch.equal(expected[n], got[n]) for n in NAMES)

    assert all(run_ranks(2, body))


def test_the_state_covers_stats_schedule_position_and_generators():
    bundle = SETUPS["legacy-epoch-topk"]()
    run_ranks(1, lambda backend: [step(bundle, backend, i) for i in range(3)])
    state = bundle.state_dict()
    assert state["compressor"]["optimizer_steps"] == 3 and state["compressor"]["epoch"] == 1
    assert state["traffic"]["total"][2] == 3 * len(NAMES)
    assert set(state["memory"]["residuals"]) == set(NAMES)
    assert state["placement"] == [0, 1]
    qsgd = SETUPS["qsgd"]()
    run_ranks(1, lambda backend: step(qsgd, backend, 0))
    assert qsgd.state_dict()["compressor"]["steps"] == dict.fromkeys(NAMES, 1)


def test_a_state_is_a_copy():
    bundle = Grace(TopK(0.2), memory=Residual())
    run_ranks(1, lambda backend: step(bundle, backend, 0))
    state = bundle.state_dict()
    state["memory"]["residuals"]["w"] += 1
    assert not torch.equal(bundle.memory.residuals["w"], state["memory"]["residuals"]["w"])


# -- a state saved by another configuration ------------------------------------------------------


def saved_by(make_bundle):
    bundle = make_bundle()
    run_ranks(1, lambda backend: step(bundle, backend, 0))
    return bundle.state_dict()


@pytest.mark.parametrize("saved,loaded,message", [
    (lambda: Grace(TopK(0.2), memory=Residual()), lambda: Grace(TopK(0.1), memory=Residual()),
     r"compressor: saved TopK\(ratio=0.2\), now TopK\(ratio=0.1\) \(at 'ratio=0.2' -> 'ratio=0.1'\)"),
    (lambda: Grace(TopK(0.2), memory=Residual()), lambda: Grace(TopK(0.2), memory=EF21()),
     r"memory: saved Residual\(\), now EF21\(\)"),
    (lambda: Grace(QSGD(4, seed=7)), lambda: Grace(QSGD(4, seed=8)), r"'seed=7' -> 'seed=8'"),
    (lambda: Grace(Legacy(TopK(), by="epoch", values=[0.5, 0.1], epochs=4)),
     lambda: Grace(Legacy(TopK(), by="epoch", values=[0.5, 0.1], epochs=8)), r"'epochs=4' -> 'epochs=8'"),
    (lambda: Grace(Legacy(TopK(), by="layer", values=[1.0, 0.01], splits=[100])),
     lambda: Grace(Legacy(TopK(), by="layer", values=[1.0, 0.001], splits=[100])), r"'0.01' -> '0.001'"),
    (lambda: Grace(TopK(0.2)), lambda: Grace(TopK(0.2), dense_fallback=False),
     r"dense_fallback: saved True, now False"),
    (lambda: Grace(Accordion(TopK(), low=0.5, high=0.05, interval=2)),
     lambda: Grace(Accordion(TopK(), low=0.5, high=0.05, interval=3)), r"'interval=2' -> 'interval=3'"),
])
def test_a_state_saved_by_another_configuration_is_refused(saved, loaded, message):
    state = saved_by(saved)
    bundle = loaded()
    run_ranks(1, lambda backend: step(bundle, backend, 0))
    before = bundle.state_dict()
    with pytest.raises(ValueError, match=message):
        bundle.load_state_dict(state)
    assert not differences(bundle.state_dict(), before), "a refused load must change nothing"


def test_every_difference_is_named():
    state = saved_by(lambda: Grace(TopK(0.2), memory=Residual()))
    with pytest.raises(ValueError, match=r"(?s)compressor: saved TopK.*memory: saved Residual"):
        Grace(RandomK(0.2), memory=NoMemory()).load_state_dict(state)


def test_compressors_and_memories_alone_refuse_another_configuration():
    schedule = Legacy(TopK(), by="epoch", values=[0.5, 0.1], epochs=4)
    with pytest.raises(ValueError, match=r"(?s)Legacy.load_state_dict: .*'epochs=4' -> 'epochs=2'"):
        Legacy(TopK(), by="epoch", values=[0.5, 0.1], epochs=2).load_state_dict(schedule.state_dict())
    with pytest.raises(ValueError, match=r"(?s)DGCMemory.load_state_dict: .*'momentum=0.9' -> 'momentum=0.5'"):
        DGCMemory(0.5).load_state_dict(DGCMemory(0.9).state_dict())
    with pytest.raises(ValueError, match=r"(?s)NoMemory.load_state_dict: .*saved Residual\(\), now NoMemory\(\)"):
        NoMemory().load_state_dict(Residual().state_dict())


def test_something_that_is_not_a_state_is_refused():
    with pytest.raises(ValueError, match=r"Grace.load_state_dict: expected a state from Grace.state_dict\(\)"):
        Grace(TopK(0.2)).load_state_dict({"residuals": {}})
    with pytest.raises(ValueError, match=r"Residual.load_state_dict: expected a state"):
        Residual().load_state_dict([])


def test_adaptive_decisions_are_state_not_configuration():
    """Accordion's and L-GreCo's reprs carry a digest of their decisions (for the rank
    consistency check); a state taken after some decisions must still load into a fresh one."""
    for setup in ("accordion", "lgreco"):
        bundle = SETUPS[setup]()
        run_ranks(1, lambda backend, bundle=bundle: [step(bundle, backend, i) for i in range(4)])
        fresh = SETUPS[setup]()
        fresh.load_state_dict(through_disk(bundle.state_dict()))
        assert repr(fresh) == repr(bundle)


# -- a state saved by another rank -----------------------------------------------------------------


def test_each_rank_must_load_its_own_state():
    def save(backend):
        bundle = Grace(TopK(0.2), memory=Residual())
        step(bundle, backend, 0)
        return bundle.state_dict()

    states = run_ranks(2, save)

    def load_swapped(backend):
        bundle = Grace(TopK(0.2), memory=Residual())
        bundle.load_state_dict(states[1 - backend.rank()])
        step(bundle, backend, 1)

    with pytest.raises(ValueError, match=r"this rank \(\d of 2\) loaded the state that rank \d of 2 saved"):
        run_ranks(2, load_swapped)

    def load_on_one_rank(backend):
        bundle = Grace(TopK(0.2), memory=Residual())
        bundle.load_state_dict(states[0])
        step(bundle, backend, 1)

    with pytest.raises(ValueError, match=r"this rank \(0 of 1\) loaded the state that rank 0 of 2 saved"):
        run_ranks(1, load_on_one_rank)
