"""DGCMemory: momentum correction, factor masking and local clipping, against a reference run here."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import DGC, FP16, QSGD, Grace, Legacy, NoCompression, RandomK, Threshold, TopK
from grace_legacy.memories.dgc import DGCMemory


def gradients(seed: int, n: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(steps)]


@given(seed=st.integers(0, 2**16), n=st.integers(1, 600), steps=st.integers(1, 6), ratio=st.floats(0.01, 1.0),
       momentum=st.floats(0.0, 0.99), which=st.sampled_from(["dgc", "topk", "randomk", "threshold"]))
@settings(max_examples=80, deadline=None)
def test_momentum_correction_and_factor_masking(seed, n, steps, ratio, momentum, which):
    compressor = {"dgc": DGC(ratio, min_samples=8), "topk": TopK(ratio), "randomk": RandomK(ratio, seed=seed),
                  "threshold": Threshold(0.5 + ratio)}[which]
    memory = DGCMemory(momentum=momentum)
    u, v = torch.zeros(n), torch.zeros(n)
    for grad in gradients(seed, n, steps):
        u = momentum * u + grad
        v = v + u
        compensated = memory.compensate(grad, "w")
        assert torch.equal(compensated, v), "compress the accumulated velocity v"
        payload, ctx = compressor.compress(compensated, "w")
        memory.update(compensated, "w", compressor, payload, ctx)
        sent = compressor.decompress(payload, ctx)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[compressor.support(payload, ctx).long()] = True
        # What was sent is v on the sent entries; masking zeroes u and v there and nowhere else.
        assert torch.equal(sent[mask], v[mask]) and torch.count_nonzero(sent[~mask]) == 0
        assert torch.equal(memory.velocities["w"], torch.where(mask, 0.0, u))
        assert torch.equal(memory.accumulations["w"], torch.where(mask, 0.0, v))
        # Nothing is lost: what was sent plus what stays accumulated is v.
        assert torch.equal(sent + memory.accumulations["w"], v)
        u, v = torch.where(mask, 0.0, u), torch.where(mask, 0.0, v)


def test_a_dense_step_sends_everything_and_restarts_both_buffers():
    memory = DGCMemory(momentum=0.5)
    grad = torch.tensor([1.0, -2.0, 3.0])
    c = TopK(0.34)
    compensated = memory.compensate(grad, "w")
    memory.update(compensated, "w", c, *c.compress(compensated, "w"))
    assert torch.equal(memory.accumulations["w"], torch.tensor([1.0, -2.0, 0.0]))
    compensated = memory.compensate(grad, "w")
    # u = 0.5 * [1, -2, 0] + g = [1.5, -3, 3]; v = [1, -2, 0] + u.
    assert torch.equal(compensated, torch.tensor([2.5, -5.0, 3.0]))
    memory.update(compensated, "w", NoCompression(), [compensated], None)
    assert "w" not in memory.velocities and "w" not in memory.accumulations
    assert torch.equal(memory.compensate(grad, "w"), grad)


@given(seed=st.integers(0, 2**16), n=st.integers(1, 300), clip=st.floats(1e-3, 50.0), scale=st.floats(1e-3, 1e3))
@settings(max_examples=80, deadline=None)
def test_local_clipping_bounds_each_gradients_l2_norm_before_accumulation(seed, n, clip, scale):
    grad = gradients(seed, n, 1)[0] * scale
    memory = DGCMemory(momentum=0.9, clip=clip)
    clipped = memory.compensate(grad, "w")  # first step: u = v = clip(g)
    norm = float(torch.linalg.vector_norm(grad.double()))
    if norm <= clip:
        assert torch.equal(clipped, grad)
    else:
        # Same direction, norm clip (up to fp32 rounding of the scale factor).
        factor = clip / norm
        assert torch.allclose(clipped.double(), grad.double() * factor, rtol=1e-6, atol=0)
        assert math.isclose(float(torch.linalg.vector_norm(clipped.double())), clip, rel_tol=1e-6)
    # Clipping acts on the gradient, not on the accumulation: v may exceed clip after two steps.
    again = memory.compensate(grad, "w")
    expected_u = 0.9 * clipped + memory.clipped(grad)
    assert torch.equal(again, clipped + expected_u)


def test_clipping_is_computed_in_fp32_for_half_gradients():
    grad = torch.full((1000,), 100.0, dtype=torch.float16)  # sum of squares overflows fp16
    out = DGCMemory(clip=1.0).compensate(grad, "w")
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert math.isclose(float(torch.linalg.vector_norm(out.float())), 1.0, rel_tol=1e-2)


def test_dgc_memory_refuses_a_compressor_that_cannot_say_what_it_sent():
    with pytest.raises(ValueError, match=r"DGCMemory masks the entries.*FP16"):
        Grace(FP16(), memory=DGCMemory())
    with pytest.raises(ValueError, match=r"DGCMemory masks the entries.*QSGD"):
        Grace(Legacy(QSGD(), by="layer", values=[4]), memory=DGCMemory())
    Grace(Legacy(TopK(), by="layer", values=[0.1]), memory=DGCMemory())


def test_dgc_memory_state_dict_round_trip_is_a_copy():
    memory = DGCMemory(momentum=0.5)
    c = TopK(0.5)
    for grad in gradients(0, 8, 2):
        compensated = memory.compensate(grad, "w")
        memory.update(compensated, "w", c, *c.compress(compensated, "w"))
    state = memory.state_dict()
    restored = DGCMemory(momentum=0.5)
    restored.load_state_dict(state)
    memory.velocities["w"] += 1
    grad = torch.randn(8)
    fresh = DGCMemory(momentum=0.5)
    fresh.load_state_dict(state)
    assert torch.equal(restored.compensate(grad, "w"), fresh.compensate(grad, "w"))
    assert set(state) == {"config", "velocities", "accumulations"}


def test_dgc_memory_rejects_a_tensor_that_changed_shape():
    memory = DGCMemory()
    memory.compensate(torch.zeros(3), "w")
    with pytest.raises(ValueError, match="DGCMemory: tensor 'w' changed from"):
        memory.compensate(torch.zeros(4), "w")


@pytest.mark.parametrize("kwargs,message", [
    ({"momentum": -0.1}, r"DGCMemory: momentum must be a number in \[0, 1\)"),
    ({"momentum": 1.0}, r"DGCMemory: momentum must be a number in \[0, 1\)"),
    ({"momentum": float("nan")}, r"DGCMemory: momentum"),
    ({"clip": 0}, r"DGCMemory: clip must be None or a finite number > 0"),
    ({"clip": -1.0}, r"DGCMemory: clip must be None or a finite number > 0"),
    ({"clip": float("inf")}, r"DGCMemory: clip must be None or a finite number > 0"),
])
def test_invalid_dgc_memory_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DGCMemory(**kwargs)
