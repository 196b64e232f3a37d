"""A step whose gradient held an inf or NaN on some rank is skipped; every stateful compressor and
memory must then return exactly to where it was, and keep nothing non-finite."""

import pytest
import torch

from grace_legacy import Grace, Legacy, PowerSGD, PowerSGDMemory, Residual, ScatterGather, Signum, TopK
from grace_legacy.core.state import UndoLog
from tests.helpers import run_ranks
from tests.registry import compressor_memory_pairs

#: Every compressor of the registry with every memory it accepts, and a schedule whose configured
#: copies share their base's state.
SETUPS = compressor_memory_pairs() + [
    ("Legacy(PowerSGD) by epoch+PowerSGDMemory",
     lambda: Grace(Legacy(PowerSGD(), by="epoch", values=[3, 2], epochs=2), memory=PowerSGDMemory())),
]


def local_step(compressor, memory, grad: torch.Tensor, name: str = "w") -> torch.Tensor:
    """One worker's step, the exchange being with itself (sums of one payload)."""
    compensated = memory.compensate(grad, name)
    concrete = compressor.compressor_for(compensated, name)
    payload, ctx = concrete.compress(compensated, name)
    for _ in range(1, concrete.traits.rounds):
        payload, ctx = concrete.next_round(payload, ctx)
    memory.update(compensated, name, concrete, payload, ctx)
    if concrete.traits.rounds > 1:
        concrete.end_exchange(payload, ctx)
    return memory.aggregated(name, concrete.decompress(payload, ctx))


def tensors_of(state, prefix=""):
    """Flatten a nested state dict to {path: tensor}, skipping counters that move on by design."""
    out = {}
    for key, value in state.items():
        if key in ("steps", "traffic"):
            continue
        if isinstance(value, dict):
            out.update(tensors_of(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("setup", SETUPS, ids=[label for label, _ in SETUPS])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_rolled_back_step_leaves_no_trace(setup, poison):
    bundle = setup[1]()
    compressor, memory = bundle.compressor, bundle.memory
    torch.manual_seed(0)
    for _ in range(2):
        local_step(compressor, memory, torch.randn(12, 10))
        memory.end_step()
        compressor.end_step()
    before = {**tensors_of(compressor.state_dict(), "c."), **tensors_of(memory.state_dict(), "m.")}
    if not before:
        pytest.skip("keeps no state between steps")
    bad = torch.randn(12, 10)
    bad[3, 4] = poison
    local_step(compressor, memory, bad)
    memory.undo("w")
    compressor.undo("w")
    after = {**tensors_of(compressor.state_dict(), "c."), **tensors_of(memory.state_dict(), "m.")}
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key
        assert bool(torch.isfinite(after[key]).all()), key


def test_commit_forgets_what_rollback_would_restore():
    memory = Residual()
    local_step(TopK(0.3), memory, torch.randn(20))
    memory.end_step()
    kept = memory.residuals["w"]
    memory.undo("w")
    assert memory.residuals["w"] is kept


#: Compressors with per-tensor state that the scatter-gather compresses segment by segment, each
#: segment under ``name[start:stop]``.
SEGMENTED = [("Signum", lambda: Grace(Signum(0.9), communicator=ScatterGather())),
             ("TopK+Residual", lambda: Grace(TopK(0.3), memory=Residual(), communicator=ScatterGather()))]


@pytest.mark.parametrize("setup", SEGMENTED, ids=[label for label, _ in SEGMENTED])
def test_undoing_a_tensor_undoes_its_segments_state_on_the_scatter_gather(setup):
    def body(backend):
        bundle = setup[1]()
        torch.manual_seed(backend.rank())
        for _ in range(2):
            bundle.start(torch.randn(40), "w", backend, average=True)()
            bundle.end_step(backend)
        before = {**tensors_of(bundle.compressor.state_dict(), "c."),
                  **tensors_of(bundle.owner_memory.state_dict() if bundle.owner_memory else {}, "o.")}
        bundle.start(torch.randn(40), "w", backend, average=True)()
        bundle.guard.undo("w")
        after = {**tensors_of(bundle.compressor.state_dict(), "c."),
                 **tensors_of(bundle.owner_memory.state_dict() if bundle.owner_memory else {}, "o.")}
        return before, after

    for before, after in run_ranks(3, body):
        assert any("[" in key for key in before), sorted(before)  # segment state exists
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), key


def test_an_undo_log_undoes_a_tensors_parts_and_nothing_else():
    store = {"w": 1, "w[0:3]": 2, "w2[0:3]": 3}
    log = UndoLog()
    for key in ("w", "w[0:3]", "w2[0:3]", "w[3:6]"):
        log.remember(store, key)
    store.update({"w": 10, "w[0:3]": 20, "w2[0:3]": 30, "w[3:6]": 40})
    log.undo("w")
    assert store == {"w": 1, "w[0:3]": 2, "w2[0:3]": 30}
