"""QSGD, TernGrad and Natural compress in one compiled pass on a CPU and in place elsewhere, for
speed; here both ways are held, bit for bit, to the straightforward formulas they replaced (one
fresh tensor per step, ``torch.where`` for every case), with the same random draws, over random
tensors full of the awkward values: signed zeros, subnormals, infinities, NaN, and magnitudes far
below the largest. And the input is never written.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from grace_legacy import QSGD, Natural, TernGrad
from grace_legacy.compressors.kernels import compiled
from grace_legacy.compressors.kernels.draws import uniform
from grace_legacy.compressors.kernels.natural_passes import NATURAL_SPAN, NON_FINITE_CODE, pow2
from grace_legacy.compressors.qsgd import level_dtype
from grace_legacy.compressors.quantization import float32_at_least
from grace_legacy.compressors.terngrad import CLIP_SIGMAS
from grace_legacy.core.seeds import derived_seed

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
AWKWARD = [0.0, -0.0, 1e-45, -1e-40, 1e-30, -3e38, 2.5, -2.5, float("inf"), float("-inf"), float("nan")]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.fixture(params=["compiled", "tensor"], autouse=True)
def way(request, monkeypatch):
    """Every test here runs twice: with the compiled CPU passes, and with the tensor arithmetic
    other devices use."""
    monkeypatch.setattr(compiled, "ENABLED", request.param == "compiled")
    return request.param


def draws(compressor, name: str, step: int, tensor: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    return uniform(derived_seed(compressor.seed, compressor.rank, name, step), tensor.numel(), work)


def exact_norm(x: torch.Tensor) -> float:
    """The 2-norm of ``x`` from exact arithmetic, within an ulp (inf or NaN if an element is)."""
    values = x.double().tolist()
    if not all(map(math.isfinite, values)):
        return math.fsum(abs(v) for v in values)
    squares = sum(Fraction(v) ** 2 for v in values)
    # The root of the exact sum, scaled by a power of 4 that keeps float(squares) in range.
    shift = max(0, -squares.numerator.bit_length() + squares.denominator.bit_length() + 600) // 2
    return math.ldexp(math.sqrt(float(squares * 4**shift)), -shift)


def assert_sent_norm(norm: torch.Tensor, x: torch.Tensor) -> None:
    """The norm sent is the float32 rounded up from the exact norm, to within the float64 rounding
    of summing squares (the CPU sums in element order, other devices in their own)."""
    exact = exact_norm(x)
    if math.isnan(exact) or math.isinf(exact):
        assert not torch.isfinite(norm).item()
        return
    assert float32_at_least(exact * (1 - 1e-12)) <= norm.item() <= float32_at_least(exact * (1 + 1e-12))


def qsgd_formula(tensor: torch.Tensor, s: int, draw: torch.Tensor, work: torch.dtype,
                 norm: torch.Tensor) -> list[torch.Tensor]:
    x = tensor.reshape(-1).to(work)
    usable = torch.isfinite(norm) & (norm > 0)
    ratio = torch.where(usable, x.abs() / norm.to(work) * s, 0.0).clamp(0, s)
    lower = ratio.floor()
    level = lower + (draw < ratio - lower).to(work)
    return [norm.reshape(1), torch.where(x < 0, -level, level).to(level_dtype(s))]


def terngrad_formula(tensor: torch.Tensor, draw: torch.Tensor, work: torch.dtype) -> list[torch.Tensor]:
    """With the bound TernGrad computed (its sigma is checked on its own)."""
    x = tensor.reshape(-1).to(work)
    bound = torch.tensor(TernGrad().clip_bound(x)[0], dtype=work)
    clipped = torch.where(x > bound, bound, torch.where(x < -bound, -bound, x))
    # minimum propagates NaN: any NaN, or an inf that makes sigma NaN, gives a NaN scale.
    scale = torch.tensor(float32_at_least(torch.minimum(x.abs().amax(), bound).item()))
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


def test_the_loops_dtype_test_is_decided_when_they_compile():
    # The loops branch on is_single(x) for the float32 or float64 layout; it must answer for the
    # array's type, and be usable where the loops are.
    import numba

    @numba.njit
    def single(x):
        return compiled.is_single(x)

    assert single(np.zeros(3, np.float32)) is True
    assert single(np.zeros(3, np.float64)) is False
    with pytest.raises(NotImplementedError):
        compiled.is_single(np.zeros(3, np.float32))


@given(case=tensors(), levels=st.sampled_from([1, 2, 16, 127, 128, 40_000, 2**25]))
@settings(max_examples=150, deadline=None)
def test_qsgd_is_its_formula(case, levels):
    """The levels follow the formula for the norm sent; the norm is checked on its own."""
    work = torch.float64 if levels > 2**24 else None
    values, scale, dtype = case
    tensor = (torch.tensor(values, dtype=torch.float64) * scale).to(dtype)
    sent, _ = QSGD(levels, seed=5).compress(tensor, "w")
    assert_sent_norm(sent[0][0], tensor.to(work or work_dtype(dtype)))
    assert_follows(QSGD(levels, seed=5), case,
                   lambda t, d, w: qsgd_formula(t, levels, d, w, sent[0][0]), work)


@pytest.mark.parametrize("values", [[2.2250738585e-311], [0.0, 1.5e-258], [1e-200, -3e-190, 0.0],
                                    [5e-324, -5e-324], [1e-160, 1.0]])
@pytest.mark.parametrize("levels", [1, 16, 2**25])
def test_qsgd_norm_of_float64_elements_whose_squares_underflow(values, levels):
    """Squares below float64's range would sum to 0 and send nothing: the norm is rescaled."""
    case = (values, 1.0, torch.float64)
    tensor = torch.tensor(values, dtype=torch.float64)
    sent, _ = QSGD(levels, seed=5).compress(tensor, "w")
    assert sent[0][0] > 0
    assert_sent_norm(sent[0][0], tensor)
    assert_follows(QSGD(levels, seed=5), case, lambda t, d, w: qsgd_formula(t, levels, d, w, sent[0][0]))


@given(case=tensors())
@example(case=([0.0] * 5 + [-3e38, -3e38], 1.0, torch.float32))  # sigma fits, float32 squares do not
@settings(max_examples=150, deadline=None)
def test_terngrad_clips_at_two_and_a_half_sigma_of_the_exact_spread(case):
    values, scale, dtype = case
    x = (torch.tensor(values, dtype=torch.float64) * scale).to(dtype).to(work_dtype(dtype))
    bound, largest = TernGrad().clip_bound(x)
    exact = [Fraction(v) for v in x.double().tolist()] if bool(x.isfinite().all()) else None
    if bool(x.isnan().any()):
        assert math.isnan(bound) and math.isnan(largest)
        return
    assert largest == float(x.abs().max())
    if exact is None:  # an infinity: sigma is NaN unless every element is the same
        assert math.isnan(bound) or (bound == math.inf and bool((x == x[0]).all()))
        return
    if len(set(exact)) == 1:
        assert bound == math.inf
        return
    mean = sum(exact) / len(exact)
    sigma = math.sqrt(sum((v - mean) ** 2 for v in exact) / len(exact))
    want = float(torch.tensor(CLIP_SIGMAS * sigma, dtype=torch.float64).to(x.dtype))
    # Float32 sums of squares (torch.std) may lose a few bits more than float64 passes.
    assert bound == pytest.approx(want, rel=1e-5 if x.dtype == torch.float32 else 1e-12)


@given(case=tensors())
@settings(max_examples=150, deadline=None)
def test_terngrad_is_its_formula(case):
    assert_follows(TernGrad(seed=5), case, terngrad_formula)


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


def compressed(case, compressor):
    """``(tensor, payload, ctx)``: the case's tensor and what ``compressor`` makes of it."""
    values, scale, dtype = case
    tensor = (torch.tensor(values, dtype=torch.float64) * scale).to(dtype)
    return (tensor, *compressor.compress(tensor, "w"))


@given(case=tensors(), levels=st.sampled_from([1, 16, 128, 2**25]))
@settings(max_examples=60, deadline=None)
def test_qsgd_decodes_as_its_formula(case, levels):
    compressor = QSGD(levels, seed=3)
    tensor, payload, ctx = compressed(case, compressor)
    norm, signed = payload
    want = (norm.to(ctx.work) * (signed.to(ctx.work) / levels)).to(ctx.dtype).view(tensor.shape)
    same_bits([compressor.decompress(payload, ctx)], [want])


@given(case=tensors())
@settings(max_examples=60, deadline=None)
def test_terngrad_decodes_as_its_formula(case):
    compressor = TernGrad(seed=3)
    tensor, payload, ctx = compressed(case, compressor)
    scale_sent, ternary = payload
    want = (scale_sent.to(ctx.work) * ternary.to(ctx.work)).to(ctx.dtype).view(tensor.shape)
    same_bits([compressor.decompress(payload, ctx)], [want])


@pytest.mark.parametrize("make", [lambda: QSGD(16, seed=1), lambda: TernGrad(seed=1), lambda: Natural(seed=1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_strided_gradients_compress_as_their_contiguous_copies(make, dtype):
    base = torch.randn(40, 30, dtype=dtype)
    for strided in (base.t(), base[:, ::3], base.reshape(-1)[::7]):
        assert not strided.is_contiguous()
        got, _ = make().compress(strided, "w")
        want, _ = make().compress(strided.contiguous(), "w")
        same_bits(got, want)


@given(value=st.floats(allow_nan=True, allow_infinity=True))
def test_float32_at_least_is_the_least_float32_not_below(value):
    rounded = float32_at_least(value)
    if math.isnan(value):
        assert math.isnan(rounded)
        return
    as_float32 = torch.tensor(rounded, dtype=torch.float32)
    assert float(as_float32) == rounded  # a float32
    assert rounded >= value
    below = float(torch.nextafter(as_float32, torch.tensor(float("-inf"))))
    assert below < value or math.isinf(value)


@given(case=tensors())
@settings(max_examples=60, deadline=None)
def test_natural_decodes_as_its_code_bytes_say(case):
    compressor = Natural(seed=3)
    tensor, payload, ctx = compressed(case, compressor)
    top = int(payload[0])

    def value(byte: int) -> float:
        if byte == NON_FINITE_CODE:
            return math.nan
        magnitude = 0.0 if byte & 0x7F == 0 else math.ldexp(1.0, top - NATURAL_SPAN + (byte & 0x7F))
        return -magnitude if byte & 0x80 else magnitude

    want = torch.tensor([value(b) for b in payload[1].tolist()], dtype=torch.float64).to(ctx.dtype).view(tensor.shape)
    same_bits([compressor.decompress(payload, ctx)], [want])
