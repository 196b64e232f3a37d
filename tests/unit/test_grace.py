"""The ``Grace`` bundle (``grace_legacy/grace.py``): the memory a compressor gets by default and the
communicators it may not take; and non-finite steps: a NaN or inf in a rank's gradient, in its
compensated gradient, or only in the synchronized sum is flagged on every rank (a NaN that
compression drops included), and undoing the step leaves no non-finite state behind."""

from __future__ import annotations

import math

import pytest
import torch

from grace_legacy import FP16, Allgather, Allreduce, Grace, NoMemory, RandomK, Residual, SignSGD, Threshold, TopK
from tests.helpers import run_ranks
from tests.unit.test_checkpoint import NAMES, SETUPS, differences, gradient, step, step_results


def test_grace_defaults_and_validation():
    assert isinstance(Grace(TopK(0.1)).memory, Residual)
    assert isinstance(Grace(FP16()).memory, NoMemory)
    with pytest.raises(ValueError, match="non-additive"):
        Grace(TopK(0.1), communicator=Allreduce())
    Grace(TopK(0.1), communicator=Allgather())
    Grace(RandomK(0.1), communicator=Allreduce())
    with pytest.raises(TypeError, match="compressor must be"):
        Grace("topk")
    with pytest.raises(TypeError, match="memory must be"):
        Grace(TopK(0.1), memory=TopK(0.1))


@pytest.mark.parametrize("memory_class", [Residual, NoMemory])
def test_grace_flags_a_raw_nan_that_compression_drops(memory_class):
    """Residual and NoMemory keep NaNs, so Grace looks only at what they return; a NaN that
    Threshold never sends is still flagged, on every rank."""
    assert memory_class.keeps_nonfinite

    def body(backend):
        memory = memory_class()
        if memory_class is Residual:
            memory.residuals["w"] = torch.zeros(1000)  # so that compensate makes g + e
        bundle = Grace(Threshold(0.5), memory)
        g = torch.linspace(-1, 1, 1000)
        if backend.rank() == 0:
            g[7] = float("nan")
        result = bundle.start(g, "w", backend, average=True)()
        assert bool(torch.isfinite(result).all())  # only the flag can tell
        return bundle.guard.nonfinite_names(["w"], backend)

    assert run_ranks(2, body) == [{"w"}, {"w"}]


# -- non-finite steps --------------------------------------------------------------------------------


def poisoned(where: dict[tuple[int, int], tuple[str, int, float]]):
    """Gradients with ``value`` at flat ``index`` of tensor ``name`` on (rank, step) in ``where``."""
    def gradients(rank: int, index: int, name: str) -> torch.Tensor:
        g = gradient(rank, index, name)
        plan = where.get((rank, index))
        if plan is not None and plan[0] == name:
            g.view(-1)[plan[1]] = plan[2]
        return g
    return gradients


def all_finite(state) -> bool:
    if isinstance(state, dict):
        return all(all_finite(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    return True


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_nonfinite_gradient_on_one_rank_is_flagged_everywhere_and_rolled_back(setup, value):
    gradients = poisoned({(1, 1): ("w", 5, value)})

    def body(backend):
        bundle = SETUPS[setup]()
        step(bundle, backend, 0, gradients)
        before = bundle.state_dict()["memory"]
        step_results(bundle, backend, 1, gradients)
        flagged = bundle.guard.nonfinite_names(NAMES, backend)
        for n in NAMES:
            bundle.guard.undo(n)
        bundle.end_step(backend)
        state = bundle.state_dict()
        return flagged, all_finite(state), not differences(state["memory"], before)

    for flagged, finite, restored in run_ranks(2, body):
        assert "w" in flagged and finite and restored


def test_an_overflow_of_finite_gradients_is_flagged_too():
    """FP16 turns 1e5 into inf: the synchronized gradient is not finite though no rank's was, so
    GradScaler skips the step, and the residual must not keep -inf."""
    gradients = poisoned({(0, 1): ("v", 3, 1e5)})

    def body(backend):
        bundle = Grace(FP16(), memory=Residual())
        flags = []
        for i in range(3):
            results = step_results(bundle, backend, i, gradients)
            flagged = bundle.guard.nonfinite_names(NAMES, backend)
            flags.append((flagged, bool(torch.isfinite(results["v"]).all())))
            if flagged:
                for n in NAMES:
                    bundle.guard.undo(n)
            bundle.end_step(backend)
        return flags, all_finite(bundle.state_dict())

    for flags, finite in run_ranks(2, body):
        assert flags == [(set(), True), ({"v"}, False), (set(), True)] and finite


def test_a_compensated_gradient_that_overflows_is_flagged():
    """Every gradient is finite, but error feedback adds a residual as large: the sum is inf, and
    a sign drops it (sign(inf) = +1), so only the compensated gradient shows it."""
    big = torch.finfo(torch.float32).max / 1.5
    gradients = poisoned({(0, 0): ("v", 0, big), (0, 1): ("v", 0, big)})

    def body(backend):
        bundle = Grace(SignSGD(), memory=Residual())
        flags = []
        for i in range(2):
            results = step_results(bundle, backend, i, gradients)
            flags.append((bundle.guard.nonfinite_names(NAMES, backend), bool(torch.isfinite(results["v"]).all())))
            if flags[-1][0]:
                for n in NAMES:
                    bundle.guard.undo(n)
            bundle.end_step(backend)
        return flags, all_finite(bundle.state_dict())

    for flags, finite in run_ranks(2, body):
        assert flags == [(set(), True), ({"v"}, True)] and finite
