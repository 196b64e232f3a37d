"""EF21: each rank's estimate moves by what it sent; the applied gradient is the running aggregate."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import EF21, Grace, NoCompression, Threshold, TopK
from grace_legacy.communicators import Allgather


def gradient(seed: int, n: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@given(seed=st.integers(0, 2**16), n=st.integers(1, 300), steps=st.integers(1, 6), ratio=st.floats(0.01, 1.0))
@settings(max_examples=80, deadline=None)
def test_local_estimate_moves_by_exactly_what_was_sent(seed, n, steps, ratio):
    compressor, memory = TopK(ratio), EF21()
    local = torch.zeros(n)
    for step in range(steps):
        grad = gradient(seed + step, n, torch.float32)
        compensated = memory.compensate(grad, "w")
        if step == 0:
            assert compensated is grad, "g_i starts at 0: the first step compresses the gradient itself"
        assert torch.equal(compensated, grad - local)
        payload, ctx = compressor.compress(compensated, "w")
        memory.update(compensated, "w", compressor, payload, ctx)
        local = local + compressor.decompress(payload, ctx)
        assert torch.equal(memory.local["w"], local)


def run_ranks_by_hand(ranks: int, steps: int, n: int, seed: int, average: bool, compressor_of) -> None:
    """P ranks in one process: each compresses grad - g_i, the payloads are aggregated, and every
    rank's aggregated() must return the previous estimate plus the aggregate."""
    memories = [EF21() for _ in range(ranks)]
    compressors = [compressor_of() for _ in range(ranks)]
    estimate = torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        grads = [gradient(1000 * step + 17 * r + seed, n) for r in range(ranks)]
        sent = []
        for r in range(ranks):
            compensated = memories[r].compensate(grads[r], "w")
            payload, ctx = compressors[r].compress(compensated, "w")
            memories[r].update(compensated, "w", compressors[r], payload, ctx)
            sent.append(payload)
        total = compressors[0].aggregate(sent, ctx, average)
        estimate = estimate + total
        applied = [memories[r].aggregated("w", total) for r in range(ranks)]
        for r in range(ranks):
            assert torch.equal(applied[r], estimate)
        # The estimate tracks op_r g_i: the mean (Average) or the sum (Sum) of the local estimates.
        locals_sum = sum(m.local["w"] for m in memories)
        target = locals_sum / ranks if average else locals_sum
        torch.testing.assert_close(estimate, target, rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 2**16), ranks=st.integers(1, 5), steps=st.integers(1, 5), n=st.integers(1, 200),
       ratio=st.floats(0.05, 1.0), average=st.booleans())
@settings(max_examples=60, deadline=None)
def test_aggregated_returns_the_running_estimate_of_the_mean_or_sum(seed, ranks, steps, n, ratio, average):
    run_ranks_by_hand(ranks, steps, n, seed, average, lambda: TopK(ratio))


def test_empty_threshold_payloads_leave_the_estimates_unchanged():
    run_ranks_by_hand(3, 4, 50, 0, True, lambda: Threshold(1.0))
    memory, c = EF21(), Threshold(100.0)
    grad = gradient(0, 10)
    compensated = memory.compensate(grad, "w")
    memory.update(compensated, "w", c, *c.compress(compensated, "w"))
    assert torch.count_nonzero(memory.local["w"]) == 0
    assert torch.equal(memory.compensate(grad, "w"), grad)


def test_a_dense_step_resynchronizes_the_local_estimate():
    memory = EF21()
    c = TopK(0.2)
    for seed in range(3):
        grad = gradient(seed, 20)
        compensated = memory.compensate(grad, "w")
        memory.update(compensated, "w", c, *c.compress(compensated, "w"))
    grad = gradient(9, 20)
    before = memory.local["w"].clone()
    compensated = memory.compensate(grad, "w")
    memory.update(compensated, "w", NoCompression(), [compensated], None)
    assert torch.equal(memory.local["w"], before + (grad - before))
    torch.testing.assert_close(memory.local["w"], grad, rtol=0, atol=1e-15)


def test_the_applied_gradient_is_a_copy_of_the_estimate():
    memory = EF21()
    applied = memory.aggregated("w", torch.ones(3))
    applied.zero_()  # what zero_grad(set_to_none=False) or in-place clipping would do to p.grad
    assert torch.equal(memory.aggregated("w", torch.ones(3)), torch.full((3,), 2.0))


def test_ef21_state_dict_round_trip_is_a_copy():
    memory = EF21()
    c = TopK(0.5)
    grad = gradient(0, 6)
    compensated = memory.compensate(grad, "w")
    memory.update(compensated, "w", c, *c.compress(compensated, "w"))
    memory.aggregated("w", torch.ones(6, dtype=torch.float64))
    state = memory.state_dict()
    memory.local["w"] += 1
    restored = EF21()
    restored.load_state_dict(state)
    assert set(state) == {"config", "local", "estimates"}
    assert torch.equal(restored.compensate(grad, "w"), grad - c.decompress(*c.compress(grad, "w")))
    assert torch.equal(restored.aggregated("w", torch.zeros(6, dtype=torch.float64)), torch.ones(6))


def test_ef21_rejects_a_tensor_that_changed_shape():
    memory = EF21()
    memory.update(torch.zeros(3), "w", NoCompression(), [torch.zeros(3)], None)
    with pytest.raises(ValueError, match="EF21: tensor 'w' changed from"):
        memory.compensate(torch.zeros(4), "w")


def test_ef21_goes_into_a_bundle_with_any_communicator():
    bundle = Grace(TopK(0.1), memory=EF21(), communicator=Allgather())
    assert isinstance(bundle.memory, EF21)
