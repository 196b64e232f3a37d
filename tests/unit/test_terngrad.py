"""TernGrad (``compressors/terngrad.py``): clipping at 2.5 standard deviations, unbiased for the
clipped gradient within its variance bound, ternary digits that always send the largest clipped
element, and an all-equal tensor sent exactly rather than clipped to zero."""

import math

import pytest
import torch

from grace_legacy import TernGrad
from tests.unit.test_quantization import assert_mse_within, assert_unbiased, mean_of_draws


def terngrad_reference_clip(x: torch.Tensor) -> torch.Tensor:
    """clamp(g, +-2.5 sigma), sigma the population standard deviation, written out longhand."""
    flat = x.reshape(-1).double()
    sigma = math.sqrt(sum((v - flat.mean().item()) ** 2 for v in flat.tolist()) / flat.numel())
    return flat.clamp(-2.5 * sigma, 2.5 * sigma)


def outlier_vector(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[3], x[17] = 40.0, -25.0  # far beyond 2.5 sigma: clipping must act
    return x


def test_terngrad_clips_at_two_and_a_half_standard_deviations():
    x = outlier_vector(64, seed=0)
    clipped = TernGrad().clipped(x)
    reference = terngrad_reference_clip(x)
    assert torch.allclose(clipped.double(), reference, rtol=1e-6, atol=0)
    assert float(clipped.abs().max()) < 40.0


def test_terngrad_is_unbiased_for_the_clipped_gradient_within_its_variance_bound():
    x = outlier_vector(64, seed=1)
    compressor = TernGrad(seed=4)
    scale = float(compressor.compress(x, "probe")[0][0])
    target = terngrad_reference_clip(x)
    assert scale == pytest.approx(float(target.abs().max()), rel=1e-6)
    mean, decoded = mean_of_draws(compressor, x)
    width = torch.full_like(target, scale)  # each element is 0 or sign * s
    assert_unbiased(mean, target, width)
    assert_mse_within(decoded, target, width, scale * float(target.abs().sum()))


def test_terngrad_digits_are_ternary_and_the_largest_clipped_element_is_always_sent():
    x = outlier_vector(200, seed=2)
    compressor = TernGrad(seed=0)
    clipped = compressor.clipped(x)
    for _ in range(5):
        (scale, ternary), ctx = compressor.compress(x, "w")
        assert ternary.dtype == torch.int8 and set(ternary.unique().tolist()) <= {-1, 0, 1}
        assert bool(((ternary == 0) | (ternary == clipped.sign().to(torch.int8))).all())
        assert bool((ternary[clipped.abs() == clipped.abs().max()] != 0).all())
        assert set(compressor.decompress([scale, ternary], ctx).unique().tolist()) <= {-float(scale), 0.0,
                                                                                       float(scale)}


@pytest.mark.parametrize("x", [torch.tensor(-0.3), torch.tensor([2.5]), torch.full((4, 3), -1.25)])
def test_terngrad_sends_an_all_equal_tensor_exactly_instead_of_clipping_it_to_zero(x):
    compressor = TernGrad()
    for _ in range(3):
        assert torch.equal(compressor.decompress(*compressor.compress(x, "w")), x)
