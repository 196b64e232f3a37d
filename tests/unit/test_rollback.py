"""A step whose gradient held an inf or NaN on some rank is skipped; every stateful compressor and
memory must then return exactly to where it was, and keep nothing non-finite."""

import pytest
import torch

from grace_legacy import (
    DGC,
    EF21,
    DGCMemory,
    EFSignSGD,
    EFSignSGDMemory,
    Legacy,
    NoMemory,
    OneBit,
    PowerSGD,
    PowerSGDMemory,
    RandomK,
    Residual,
    Signum,
    TopK,
)

PAIRS = [
    (lambda: TopK(0.3), Residual),
    (lambda: RandomK(0.3), Residual),
    (OneBit, Residual),
    (lambda: EFSignSGD(0.1), lambda: EFSignSGDMemory(0.1)),
    (lambda: Signum(0.9), NoMemory),
    (lambda: DGC(0.3), lambda: DGCMemory(0.9)),
    (lambda: TopK(0.3), EF21),
    (lambda: PowerSGD(2), PowerSGDMemory),
    (lambda: Legacy(PowerSGD(), by="epoch", values=[3, 2], epochs=2), PowerSGDMemory),
]


def local_step(compressor, memory, grad: torch.Tensor, name: str = "w") -> torch.Tensor:
    """One worker's step, the exchange being with itself (sums of one payload)."""
    compensated = memory.compensate(grad, name)
    concrete = compressor.resolve(compensated, name)
    payload, ctx = concrete.compress(compensated, name)
    for _ in range(1, concrete.rounds):
        payload, ctx = concrete.next_round(payload, ctx)
    memory.update(compensated, name, concrete, payload, ctx)
    if concrete.rounds > 1:
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


@pytest.mark.parametrize("make_compressor,make_memory", PAIRS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_rolled_back_step_leaves_no_trace(make_compressor, make_memory, poison):
    compressor, memory = make_compressor(), make_memory()
    torch.manual_seed(0)
    for _ in range(2):
        local_step(compressor, memory, torch.randn(12, 10))
        memory.commit()
        compressor.commit()
    before = {**tensors_of(compressor.state_dict(), "c."), **tensors_of(memory.state_dict(), "m.")}
    assert before, "the pair should keep some state"
    bad = torch.randn(12, 10)
    bad[3, 4] = poison
    local_step(compressor, memory, bad)
    memory.rollback("w")
    compressor.rollback("w")
    after = {**tensors_of(compressor.state_dict(), "c."), **tensors_of(memory.state_dict(), "m.")}
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key
        assert bool(torch.isfinite(after[key]).all()), key


def test_commit_forgets_what_rollback_would_restore():
    memory = Residual()
    local_step(TopK(0.3), memory, torch.randn(20))
    memory.commit()
    kept = memory.residuals["w"]
    memory.rollback("w")
    assert memory.residuals["w"] is kept
