"""EF-signSGD's memory (``memories/efsignsgd.py``): error feedback in units of parameter updates,
so what was sent plus the new error is the compensated gradient (up to one rounding); the
aggregate is divided by the learning rate, with any compressor; a dense send leaves no error."""

import math
from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import EFSignSGD, EFSignSGDMemory, Grace, NoCompression, TopK
from tests.helpers import synchronize
from tests.unit.test_signs import tensor_of


def half_spacing_fp32(value: float) -> Fraction:
    """Half the distance from |value| to the next fp32 above it: a bound on the rounding error of
    any fp32 operation whose result is ``value`` (round to nearest)."""
    a = torch.tensor(abs(value), dtype=torch.float32)
    return Fraction((torch.nextafter(a, torch.tensor(math.inf)) - a).item()) / 2


@given(lr=st.sampled_from([1.0, 0.1, 0.05, 3e-4]),
       steps=st.lists(st.integers(0, 2**16), min_size=1, max_size=5), n=st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_efsignsgd_memory_keeps_sent_plus_new_error_equal_to_compensated(lr, steps, n):
    compressor, memory = EFSignSGD(lr), EFSignSGDMemory(lr)
    for seed in steps:
        g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        old = memory.residuals.get("w", torch.zeros(n)).clone()
        compensated = memory.compensate(g, "w")
        assert torch.equal(compensated, g * lr + old)
        payload, ctx = compressor.compress(compensated, "w")
        memory.update(compensated, "w", compressor, payload, ctx)
        sent, error = compressor.decompress(payload, ctx), memory.residuals["w"]
        # Exactly, up to the one rounding of error = compensated - sent:
        for s, e, p in zip(sent.tolist(), error.tolist(), compensated.tolist(), strict=True):
            assert abs(Fraction(s) + Fraction(e) - Fraction(p)) <= half_spacing_fp32(e)


def test_efsignsgd_memory_divides_the_aggregate_by_lr_and_forgets_dense_sends():
    memory = EFSignSGDMemory(0.25)
    assert torch.equal(memory.aggregated("w", tensor_of([1.0, -0.5])), tensor_of([4.0, -2.0]))
    memory.residuals["w"] = tensor_of([1.0, 1.0])
    compensated = memory.compensate(tensor_of([4.0, 8.0]), "w")
    assert torch.equal(compensated, tensor_of([2.0, 3.0]))
    memory.update(compensated, "w", NoCompression(), [compensated], None)
    assert "w" not in memory.residuals


def test_efsignsgd_memory_scales_any_compressor_back_to_gradient_units():
    bundle = Grace(TopK(0.5), memory=EFSignSGDMemory(0.5), dense_fallback=False)
    result = synchronize([bundle], [[tensor_of([4.0, -1.0, 2.0, 0.5])]])[0][0]
    assert torch.equal(result, tensor_of([4.0, 0.0, 2.0, 0.0]))
    assert torch.equal(bundle.memory.residuals["w"], tensor_of([0.0, -0.5, 0.0, 0.25]))
