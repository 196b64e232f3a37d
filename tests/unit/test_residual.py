"""Error feedback (``memories/residual.py``): what was sent plus the new residual is the gradient
plus the old one; a tensor sent losslessly leaves no residual; state and shape checks. For the
compressors that send entries the residual is ``g + e`` with the sent entries zeroed in place:
bit for bit the subtraction ``(g + e) - D(C(g + e))``, never written into a tensor it did not
make, and undone to the old residual after the in-place update."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import DGC, NoCompression, RandomK, Residual, Threshold, TopK
from tests.helpers import bits


@given(steps=st.lists(st.integers(0, 2**16), min_size=1, max_size=5), n=st.integers(1, 400),
       ratio=st.floats(0.01, 1.0), use_randomk=st.booleans())
@settings(max_examples=60, deadline=None)
def test_residual_keeps_sent_plus_new_residual_equal_to_gradient_plus_old_residual(steps, n, ratio, use_randomk):
    compressor = RandomK(ratio, seed=1) if use_randomk else TopK(ratio)
    memory = Residual()
    for seed in steps:
        g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        old = memory.residuals.get("w", torch.zeros(n)).clone()
        compensated = memory.compensate(g, "w")
        payload, ctx = compressor.compress(compensated, "w")
        memory.update(compensated, "w", compressor, payload, ctx)
        sent = compressor.decompress(payload, ctx)
        assert torch.equal(sent + memory.residuals["w"], g + old)


def test_residual_forgets_a_tensor_sent_losslessly():
    memory = Residual()
    memory.residuals["w"] = torch.ones(3)
    compensated = memory.compensate(torch.ones(3), "w")
    assert torch.equal(compensated, torch.full((3,), 2.0))
    memory.update(compensated, "w", NoCompression(), [compensated], None)
    assert "w" not in memory.residuals


def test_residual_state_dict_round_trip_is_a_copy():
    memory = Residual()
    memory.residuals["w"] = torch.arange(4.0)
    state = memory.state_dict()
    memory.residuals["w"] += 1
    restored = Residual()
    restored.load_state_dict(state)
    assert torch.equal(restored.residuals["w"], torch.arange(4.0))


def test_residual_rejects_a_tensor_that_changed_shape():
    memory = Residual()
    memory.residuals["w"] = torch.zeros(3)
    with pytest.raises(ValueError, match="changed from"):
        memory.compensate(torch.zeros(4), "w")


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def sparsifier(kind: str, ratio: float):
    return {"topk": lambda: TopK(ratio), "randomk": lambda: RandomK(ratio, seed=3),
            "threshold": lambda: Threshold(ratio * 2), "dgc": lambda: DGC(ratio)}[kind]()


@given(kind=st.sampled_from(["topk", "randomk", "threshold", "dgc"]), ratio=st.sampled_from([0.001, 0.01, 0.3, 1.0]),
       n=st.integers(1, 70_000), dtype=st.sampled_from(DTYPES), steps=st.integers(1, 4), seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_residual_in_place_equals_the_subtraction_bit_for_bit(kind, ratio, n, dtype, steps, seed):
    compressor = sparsifier(kind, ratio)
    assert compressor.traits.sends_entries
    memory, reference = Residual(), None
    draw = torch.Generator().manual_seed(seed)
    for step in range(steps):
        g = torch.randn(n, generator=draw).to(dtype)
        expected_compensated = g if reference is None else g + reference
        compensated = memory.compensate(g, "w")
        assert torch.equal(compensated, expected_compensated)
        payload, ctx = compressor.compress(compensated, "w")
        sent = compressor.decompress(payload, ctx)
        reference = expected_compensated - sent
        before = g.clone()
        memory.update(compensated, "w", compressor, payload, ctx)
        memory.end_step()
        assert torch.equal(g, before), "the gradient itself must never be written into"
        if step > 0:  # compensate made g + e: the in-place path was taken
            assert memory.residuals["w"] is compensated
        assert bits(memory.residuals["w"]).equal(bits(reference)), "bit for bit, signed zeros included"


def test_residual_does_not_write_into_a_tensor_it_did_not_make():
    memory = Residual()
    memory.residuals["w"] = torch.ones(100)
    mine = torch.arange(100.0)
    compressor = TopK(0.1)
    payload, ctx = compressor.compress(mine, "w")
    memory.update(mine, "w", compressor, payload, ctx)
    assert torch.equal(mine, torch.arange(100.0))
    assert memory.residuals["w"] is not mine
    assert torch.equal(memory.residuals["w"][:90], torch.arange(90.0))


def test_a_lent_gradient_is_compensated_in_place_only_by_a_memory_that_keeps_none_of_it():
    """``compensate_borrowed`` (the DDP hook's bucket, lent for the step): Residual, whose Top-k
    residual is made of the compensated tensor itself, builds it in its own buffer and leaves the
    gradient as it was; PowerSGD's memory, whose residual is computed into a buffer of its own,
    builds g + e in the gradient's storage. Either way the residual is never the lent storage."""
    from grace_legacy import PowerSGD, PowerSGDMemory

    for memory, compressor, borrows in ((Residual(), TopK(0.1), False), (PowerSGDMemory(), PowerSGD(2), True)):
        memory.residuals["w"] = residual = torch.linspace(-1, 1, 60).reshape(6, 10)
        lent = torch.randn(6, 10, generator=torch.Generator().manual_seed(5))
        before = lent.clone()
        compensated = memory.compensate_borrowed(lent, "w")
        assert torch.equal(compensated, before + residual)
        assert (compensated.data_ptr() == lent.data_ptr()) == borrows, type(memory).__name__
        assert torch.equal(lent, before + residual if borrows else before)
        payload, ctx = compressor.compress(compensated, "w")
        if compressor.traits.rounds > 1:
            payload, ctx = compressor.next_round(payload, ctx)
        memory.update(compensated, "w", compressor, payload, ctx)
        assert memory.residuals["w"].untyped_storage().data_ptr() != lent.untyped_storage().data_ptr()
        assert memory.residuals["w"] is not residual  # a new residual, the old one untouched
        assert torch.equal(residual, torch.linspace(-1, 1, 60).reshape(6, 10))


def test_rollback_after_the_in_place_update_restores_the_old_residual():
    memory, compressor = Residual(), TopK(0.1)
    memory.residuals["w"] = old = torch.linspace(-1, 1, 50)
    kept = old.clone()
    compensated = memory.compensate(torch.randn(50), "w")
    memory.update(compensated, "w", compressor, *compressor.compress(compensated, "w"))
    assert memory.residuals["w"] is compensated
    memory.undo("w")
    assert memory.residuals["w"] is old and torch.equal(old, kept)


def test_large_results_reuse_the_buffers_of_two_steps_before_and_never_one_still_held():
    from grace_legacy import PowerSGD
    from grace_legacy.runtime.buffers import LARGE

    rows = LARGE // (4 * 256) + 1  # a matrix just above the size whose buffers are kept
    compressor, memory = PowerSGD(2), Residual()
    pointers, held = [], None
    for step in range(6):
        g = torch.randn(rows, 256, generator=torch.Generator().manual_seed(step))
        want = g + memory.residuals.get("w", torch.zeros(rows, 256))  # the plain arithmetic, made afresh
        compensated = memory.compensate(g, "w")
        assert torch.equal(bits(compensated), bits(want))
        payload, ctx = compressor.next_round(*compressor.compress(compensated, "w"))
        memory.update(compensated, "w", compressor, payload, ctx)
        assert torch.equal(bits(memory.residuals["w"]), bits(want - compressor.decompress(payload, ctx)))
        if step == 3:  # a caller keeps this residual: it is never written over
            held = (memory.residuals["w"], memory.residuals["w"].clone())
        pointers.append(memory.residuals["w"].data_ptr())
        memory.end_step()
    # Two turns: a step writes where the step before the last did, not into fresh pages...
    assert pointers[2] == pointers[0] and pointers[3] == pointers[1] and pointers[4] == pointers[0]
    # ...unless someone still holds that buffer.
    assert pointers[5] != pointers[3]
    assert torch.equal(bits(held[0]), bits(held[1]))
