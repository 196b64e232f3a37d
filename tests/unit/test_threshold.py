"""Threshold: exactly the entries at or above the threshold, empty payloads included."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import Grace, Legacy, Residual, Threshold
from grace_legacy.compressors.kernels.threshold_passes import magnitude_bound
from grace_legacy.runtime import wire

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4)])
def test_threshold_with_nothing_above_sends_an_empty_payload_that_decodes_to_zeros(dtype, shape):
    c = Threshold(10.0)
    x = (torch.rand(shape) * 2 - 1).to(dtype)
    payload, ctx = c.compress(x, "x")
    values, indices = payload
    assert values.shape == (0,) and indices.shape == (0,)
    assert values.dtype == dtype and indices.dtype == torch.int32
    out = c.decompress(payload, ctx)
    assert out.shape == x.shape and out.dtype == dtype and torch.count_nonzero(out) == 0
    # It survives the wire with its header, next to a rank that did send something.
    other, _ = c.compress(torch.full(shape, 11.0, dtype=dtype), "x")
    gathered = torch.cat([wire.pack(payload, True), wire.pack(other, True)])
    back = wire.unpack_gathered(gathered, payload, 2, True, "x")
    assert back[0][0].numel() == 0 and back[1][0].numel() == max(1, x.numel())
    total = c.aggregate(back, ctx, average=True)
    assert torch.equal(total, torch.full(shape, 5.5, dtype=dtype))
    # Error feedback keeps everything that was not sent.
    memory = Residual()
    memory.update(x, "x", c, payload, ctx)
    assert torch.equal(memory.residuals["x"], x)


@given(n=st.integers(1, 400), seed=st.integers(0, 2**16), dtype=st.sampled_from(FLOATS),
       pick=st.one_of(st.floats(1e-6, 4.0), st.integers(0, 399)))
@settings(max_examples=150, deadline=None)
def test_threshold_sends_exactly_the_entries_at_or_above_it(n, seed, dtype, pick):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    # An integer pick uses an entry's own magnitude as the threshold: the boundary is included.
    threshold = float(x[pick % n].abs().double()) if isinstance(pick, int) else pick
    if threshold == 0:
        threshold = 1e-3
    payload, ctx = Threshold(threshold).compress(x, "x")
    values, indices = payload
    # float64 holds every fp32/fp16/bf16 value exactly, so this comparison is exact.
    expected = torch.nonzero(x.double().abs() >= threshold).reshape(-1)
    assert torch.equal(indices.long(), expected)
    assert torch.equal(values, x[expected])
    restored = Threshold(threshold).decompress(payload, ctx)
    assert torch.equal(restored[expected], x[expected])
    assert torch.count_nonzero(restored) == torch.count_nonzero(x[expected])


@pytest.mark.parametrize("dtype,threshold", [(torch.float16, 0.1), (torch.bfloat16, 0.1), (torch.float32, 0.7),
                                             (torch.float64, 0.1)])
def test_threshold_is_not_fooled_by_rounding_the_threshold_to_the_dtype(dtype, threshold):
    nearest = torch.tensor(threshold, dtype=torch.float64).to(dtype)
    below = nearest if float(nearest) < threshold else torch.nextafter(nearest, torch.tensor(0.0, dtype=dtype))
    above = magnitude_bound(threshold, dtype)[0]
    assert float(below) < threshold <= float(above)
    x = torch.stack([below, above, -below, -above])
    payload, _ = Threshold(threshold).compress(x, "x")
    assert payload[1].tolist() == [1, 3]


def test_magnitude_bound_handles_the_ends_of_the_range():
    assert magnitude_bound(1e6, torch.float16)[0] == float("inf")
    tiny = magnitude_bound(1e-30, torch.float16)[0]
    assert tiny > 0 and torch.nextafter(tiny, torch.tensor(0.0, dtype=torch.float16)) == 0


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, float("nan"), float("inf")])
def test_invalid_threshold_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"Threshold: threshold must be a number in \(0, inf\)"):
        Threshold(bad)


@pytest.mark.parametrize("bad", ["0.1", True, torch.tensor(0.1)])
def test_threshold_of_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="threshold"):
        Threshold(bad)


def test_threshold_cannot_predict_its_size_so_budget_matching_refuses_it():
    with pytest.raises(NotImplementedError, match="depends on the gradient's values"):
        Threshold(0.1).payload_spec(100, torch.float32)
    # A threshold's bytes shrink as it grows and cannot be predicted: budget matching refuses it.
    with pytest.raises(ValueError, match="Legacy.budget_matched: needs a bounded continuous parameter.*threshold"):
        Legacy.budget_matched(Threshold(), 0.1, by="layer", sizes=[10, 1000], splits=[100], layer_factors=[2, 1])


def test_threshold_defaults_and_refusals():
    assert not Threshold.traits.uniform_payload and not Threshold.traits.additive
    assert isinstance(Grace(Threshold(0.1)).memory, Residual)
    with pytest.raises(ValueError, match="without its threshold"):
        Threshold().compress(torch.randn(3), "x")
    with pytest.raises(ValueError, match="empty tensor"):
        Threshold(0.1).compress(torch.zeros(0), "x")
    with pytest.raises(TypeError, match="floating point"):
        Threshold(0.1).compress(torch.arange(3), "x")
    legacy = Legacy(Threshold(), by="layer", values=[None, 0.5], splits=[10])
    assert legacy.compressor_for(torch.randn(5), "x") is None
    assert legacy.compressor_for(torch.randn(50), "x").threshold == 0.5


