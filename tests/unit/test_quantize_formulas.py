"""QSGD, TernGrad and Natural compress in place for speed; here each is held, bit for bit, to the
straightforward formulas it replaced (one fresh tensor per step, ``torch.where`` for every case),
with the same random draws, over random tensors full of the awkward values: signed zeros,
subnormals, infinities, NaN, and magnitudes far below the largest. And the input is never written.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import QSGD, Natural, TernGrad
from grace_legacy.compressors.quantize import NATURAL_SPAN, NON_FINITE_CODE, _float32_at_least, level_dtype, pow2

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
AWKWARD = [0.0, -0.0, 1e-45, -1e-40, 1e-30, -3e38, 2.5, -2.5, float("inf"), float("-inf"), float("nan")]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def draws(compressor, name: str, step: int, tensor: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    generator = compressor.generator(compressor.seed, name, step)
    return torch.rand(tensor.numel(), generator=generator, dtype=work)


def qsgd_formula(tensor: torch.Tensor, s: int, draw: torch.Tensor, work: torch.dtype) -> list[torch.Tensor]:
    x = tensor.reshape(-1).to(work)
    norm = _float32_at_least(torch.linalg.vector_norm(x, dtype=torch.float64))
    usable = torch.isfinite(norm) & (norm > 0)
    ratio = torch.where(usable, x.abs() / norm.to(work) * s, 0.0).clamp(0, s)
    lower = ratio.floor()
    level = lower + (draw < ratio - lower).to(work)
    return [norm.reshape(1), torch.where(x < 0, -level, level).to(level_dtype(s))]


def terngrad_formula(compressor: TernGrad, tensor: torch.Tensor, draw: torch.Tensor,
                     work: torch.dtype) -> list[torch.Tensor]:
    clipped = compressor.clipped(tensor)
    scale = _float32_at_least(clipped.abs().amax())
    usable = torch.isfinite(scale) & (scale > 0)
    probability = torch.where(usable, clipped.abs() / scale.to(work), 0.0)
    return [scale.reshape(1), torch.where(draw < probability, clipped.sign(), 0.0).to(torch.int8)]


def natural_formula(tensor: torch.Tensor, draw: torch.Tensor, work: torch.dtype) -> list[torch.Tensor]:
    x = tensor.reshape(-1).to(work)
    magnitude = x.abs()
    finite = torch.isfinite(x)
    present = finite & (magnitude > 0)
    mantissa, exponent = torch.frexp(torch.where(finite, magnitude, 0.0))
    a = exponent - 1
    top = torch.where(present.any(), torch.where(present, a, torch.iinfo(a.dtype).min).amax() + 1, 0)
    bottom = top - (NATURAL_SPAN - 1)
    in_range_code = a + (draw < 2 * mantissa - 1).to(a.dtype) - bottom + 1
    below_code = (draw < mantissa * pow2(exponent - bottom, work)).to(a.dtype)
    code = torch.where(a >= bottom, in_range_code, below_code)
    code = torch.where(present, code, 0)
    code = torch.where((x < 0) & (code > 0), code | 0x80, code)
    code = torch.where(finite, code, NON_FINITE_CODE)
    return [top.to(torch.int16).reshape(1), code.to(torch.uint8)]


def tensors():
    scale = st.sampled_from([1.0, 1e-20, 1e20])
    values = st.lists(st.one_of(st.sampled_from(AWKWARD), st.floats(-1e6, 1e6)), min_size=1, max_size=60)
    return st.tuples(values, scale, st.sampled_from(FLOATS))


def same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.is_floating_point():
            nan = w.isnan()
            assert torch.equal(g.isnan(), nan)
            assert torch.equal(g[~nan], w[~nan]) and torch.equal(g[~nan].signbit(), w[~nan].signbit())
        else:
            assert torch.equal(g, w)


def assert_follows(compressor, case, formula, work=None) -> None:
    """``compressor`` compresses the case's tensor as ``formula`` does with the same draws, and
    leaves the tensor as it was."""
    values, scale, dtype = case
    tensor = (torch.tensor(values, dtype=torch.float64) * scale).to(dtype)
    original = tensor.clone()
    work = work or work_dtype(dtype)
    payload, _ = compressor.compress(tensor, "w")
    same_bits(payload, formula(tensor, draws(compressor, "w", 0, tensor, work), work))
    same_bits([tensor], [original])


@given(case=tensors(), levels=st.sampled_from([1, 2, 16, 127, 128, 40_000, 2**25]))
@settings(max_examples=150, deadline=None)
def test_qsgd_is_its_formula(case, levels):
    work = torch.float64 if levels > 2**24 else None
    assert_follows(QSGD(levels, seed=5), case, lambda t, d, w: qsgd_formula(t, levels, d, w), work)


@given(case=tensors())
@settings(max_examples=150, deadline=None)
def test_terngrad_is_its_formula(case):
    compressor = TernGrad(seed=5)
    assert_follows(compressor, case, lambda t, d, w: terngrad_formula(compressor, t, d, w))


@given(case=tensors())
@settings(max_examples=150, deadline=None)
def test_natural_is_its_formula(case):
    assert_follows(Natural(seed=5), case, natural_formula)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_natural_below_the_range_follows_its_formula(dtype):
    """Elements more than 2^126 under the largest take the rare branch."""
    tensor = torch.tensor([1.0, 3e-39, -2e-40, 1e-45, 0.5], dtype=torch.float64).to(dtype)
    if dtype == torch.float64:
        tensor = tensor * torch.tensor([1.0, 1e-30, 1e-60, 1e-250, 1.0], dtype=dtype)
    compressor = Natural(seed=2)
    for step in range(5):
        payload, _ = compressor.compress(tensor, "w")
        same_bits(payload, natural_formula(tensor, draws(compressor, "w", step, tensor, dtype), dtype))
