"""A compressor that spans the step (``Fusion.hold_for_step``, ``StepGuard``), over in-process ranks:
each rank sends one selection over its gradients laid end to end in name order, whatever order
they arrive in; nothing leaves before the first result is asked for; a non-finite gradient flags
every tensor of the step and undoing restores the model's state; a step abandoned drops what was
held; one flat per dtype; the scatter-gather route equals its independent two-phase reference.
And the LEGACY reference's four compressors resume from ``state_dict`` bit for bit."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import CAT, AdaComp, Allgather, GlobalTopK, Grace, Legacy, Residual, ScatterGather
from tests.helpers import ThreadBackend, run_ranks
from tests.reference import mean_rule, per_gradient, step_units
from tests.reference_sparsifiers import GlobalTopKReference
from tests.registry import with_squared_gradients
from tests.two_phase import TwoPhase

SHAPES = {"b.weight": (3, 4), "a.bias": (5,), "c.weight": (2, 2, 2)}
#: The order each rank starts its gradients in.
ARRIVALS = [["c.weight", "b.weight", "a.bias"], ["a.bias", "c.weight", "b.weight"], ["b.weight", "a.bias", "c.weight"]]


def gradients(rank: int, step: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {name: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for name, shape in SHAPES.items()}


def run(make_bundle, world: int, steps: int, body=None, bundles=None, first_step: int = 0) -> list:
    """Each rank's results per step, every gradient started in its rank's arrival order."""
    bundles = bundles or [make_bundle() for _ in range(world)]

    def rank_body(backend: ThreadBackend) -> list:
        bundle, rank = bundles[backend.rank()], backend.rank()
        out = []
        for step in range(first_step, first_step + steps):
            local = gradients(rank, step)
            pending = {name: bundle.start(local[name].clone(), name, backend, True) for name in ARRIVALS[rank]}
            out.append({name: pending[name]() for name in SHAPES})
            bundle.end_step(backend)
        return out

    return run_ranks(world, body or rank_body)


def test_each_rank_sends_its_whole_model_top_k_whatever_order_its_gradients_arrive_in():
    world, steps = 3, 3
    got = run(lambda: Grace(GlobalTopK(0.25), communicator=Allgather(), dense_fallback=False), world, steps)
    references, memories = [GlobalTopKReference(0.25) for _ in range(world)], [Residual() for _ in range(world)]
    for step in range(steps):
        decoded, units = [], []
        for rank in range(world):
            local = gradients(rank, step)
            ((name, flat, _),) = unit = step_units(local, True)
            compensated = memories[rank].compensate(flat, name)
            payload, ctx = references[rank].compress(compensated, name)
            memories[rank].update(compensated, name, references[rank], payload, ctx)
            decoded.append(references[rank].decompress(payload, ctx))
            units.append((unit[0], local))
        expected = per_gradient(units[0][0], mean_rule(decoded), units[0][1])
        for rank in range(world):
            for name in SHAPES:
                assert torch.equal(got[rank][step][name], expected[name]), (rank, step, name)


def test_nothing_leaves_before_the_first_result_is_asked_for_and_an_abandoned_step_sends_nothing():
    def body(backend: ThreadBackend) -> None:
        bundle = Grace(GlobalTopK(0.5), communicator=Allgather(), dense_fallback=False)
        local = gradients(backend.rank(), 0)
        pending = {name: bundle.start(local[name], name, backend, True) for name in SHAPES}
        assert not backend.calls and bundle.fusion.unlaunched() == set(SHAPES)
        bundle.undo_step()  # as load_state_dict in mid-step does: the held gradients are dropped
        assert not backend.calls and not bundle.fusion.unlaunched()
        pending = {name: bundle.start(local[name], name, backend, True) for name in SHAPES}
        pending["a.bias"]()
        assert [kind for kind, _ in backend.calls] == ["allgather"] and not bundle.fusion.unlaunched()
        assert set(bundle.memory.residuals) == {"whole-step.float32"}

    run_ranks(2, body)


def test_a_nonfinite_gradient_flags_every_tensor_and_undoing_restores_the_models_state():
    def body(backend: ThreadBackend) -> tuple[set[str], bool]:
        bundle, rank = Grace(GlobalTopK(0.5), communicator=Allgather(), dense_fallback=False), backend.rank()
        for step in range(2):
            local = gradients(rank, step)
            pending = [bundle.start(local[name], name, backend, True) for name in SHAPES]
            [p() for p in pending]
            bundle.end_step(backend)
        before = bundle.memory.residuals["whole-step.float32"].clone()
        local = gradients(rank, 2)
        if rank == 1:
            local["a.bias"][2] = float("nan")
        pending = [bundle.start(local[name], name, backend, True) for name in SHAPES]
        [p() for p in pending]
        flagged = bundle.guard.nonfinite_names(sorted(SHAPES), backend)
        for name in SHAPES:
            bundle.guard.undo(name)
        return flagged, torch.equal(bundle.memory.residuals["whole-step.float32"], before)

    for flagged, restored in run_ranks(2, body):
        assert flagged == set(SHAPES) and restored


def test_one_flat_per_dtype():
    def body(backend: ThreadBackend) -> dict[str, torch.Tensor]:
        bundle = Grace(GlobalTopK(0.5), communicator=Allgather(), dense_fallback=False)
        local = gradients(backend.rank(), 0)
        local["a.bias"] = local["a.bias"].double()
        pending = {name: bundle.start(g, name, backend, True) for name, g in local.items()}
        results = {name: p() for name, p in pending.items()}
        assert set(bundle.memory.residuals) == {"whole-step.float32", "whole-step.float64"}
        return results

    for results in run_ranks(2, body):
        assert results["a.bias"].dtype == torch.float64 and results["b.weight"].dtype == torch.float32


SHARDED = {
    "GlobalTopK(0.3)+Residual": lambda: (GlobalTopK(0.3), Residual()),
    "CAT(1, 4, 128)+Residual": lambda: (CAT(1.0, 4.0, 128), Residual()),
    "AdaComp(4)": lambda: (AdaComp(4), None),
}


@pytest.mark.parametrize("label", SHARDED)
def test_the_scatter_gather_route_equals_its_two_phase_reference(label):
    world, steps = 3, 3
    got = run(lambda: Grace(*SHARDED[label](), communicator=ScatterGather()), world, steps)
    made = [SHARDED[label]() for _ in range(world)]
    memories = [memory or compressor.recommended_memory() for compressor, memory in made]
    for rank, (compressor, _) in enumerate(made):
        compressor.set_rank(rank)
    reference = TwoPhase([c for c, _ in made], memories, owner_feedback=isinstance(memories[0], Residual))
    spans = made[0][0].traits.spans_step
    for step in range(steps):
        local = [gradients(rank, step) for rank in range(world)]
        units = [step_units(local[rank], spans) for rank in range(world)]
        expected = {}
        for index, unit in enumerate(units[0]):  # each tensor (or the step's flat) sent alone, unfused
            (flat,) = reference.step([unit[0]], [[units[rank][index][1]] for rank in range(world)], True,
                                     end_step=index == len(units[0]) - 1)
            expected.update(per_gradient(unit, flat, local[0]))
        for rank in range(world):
            for name in SHAPES:
                assert torch.equal(got[rank][step][name], expected[name]), (label, rank, step, name)


RESUMED = {
    "GlobalTopK(0.2)+Residual": lambda: Grace(GlobalTopK(0.2)),
    "CAT(1, 2, 128)+Residual": lambda: Grace(CAT(1.0, 2.0, 128)),
    "AdaComp(3)": lambda: Grace(AdaComp(3)),
    # Its configured copies share the base's residues: loaded in place, every copy continues from them.
    "Legacy(AdaComp) by layer": lambda: Grace(Legacy(AdaComp(), by="layer", values=[2, 5], splits=[10])),
    "VarianceSparsifier(0.8, 0.9)": lambda: Grace(with_squared_gradients(0.8, 0.9)),
}


@pytest.mark.parametrize("label", RESUMED)
def test_a_run_resumed_from_state_dict_ends_bit_for_bit_as_the_uninterrupted_run(label):
    world = 2
    straight = run(RESUMED[label], world, 6)
    first = [RESUMED[label]() for _ in range(world)]
    run(None, world, 3, bundles=first)
    states = [bundle.state_dict() for bundle in first]
    fresh = [RESUMED[label]() for _ in range(world)]
    for bundle, state in zip(fresh, states, strict=True):
        bundle.load_state_dict(state)
    resumed = run(None, world, 3, bundles=fresh, first_step=3)
    for rank in range(world):
        for step in range(3):
            for name in SHAPES:
                assert torch.equal(resumed[rank][step][name], straight[rank][3 + step][name]), (label, rank, step)
