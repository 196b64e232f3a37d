"""QSGD, TernGrad and natural compression: unbiasedness, exact wire format, determinism.

Statistical tolerances. Each compressor rounds element ``i`` at random to one of two points
``lo_i < hi_i`` around its target, independently per draw, so one draw's error lies in an
interval of width ``w_i = hi_i - lo_i`` and has variance at most ``w_i^2 / 4``; the mean of ``K``
independent draws then has standard error at most ``w_i / (2 sqrt(K))``. Hoeffding's inequality
makes that non-asymptotic: ``P(|mean_i - target_i| >= z * w_i / (2 sqrt(K))) <= 2 exp(-z^2 / 2)``,
so ``z = sqrt(2 ln(2 n / DELTA))`` standard errors bound all ``n`` elements at once except with
probability ``DELTA``. A biased rounding rule (say, always to the nearer point) is off by a
fixed fraction of ``w_i`` that does not shrink with ``K``, so it fails; a small bias that leans
the same way on every element is caught by the sum of the deviations (see ``assert_unbiased``).

The same inequality bounds the mean squared error over ``K`` draws (each between 0 and
``sum_i w_i^2``) around its expectation, which each compressor's variance bound caps.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grace_legacy
from grace_legacy import QSGD, Grace, Legacy, Natural, NoMemory, TernGrad
from grace_legacy.compressors.kernels.draws import uniform
from grace_legacy.compressors.natural import pow2
from grace_legacy.compressors.qsgd import MAX_LEVELS, level_dtype
from grace_legacy.core.seeds import derived_seed
from grace_legacy.runtime import wire
from grace_legacy.runtime.cost import bytes_sent

DELTA = 1e-6
DRAWS = 2000
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(), (1,), (7,), (3, 4), (2, 3, 4, 5)]


def all_three():
    return [QSGD(4, seed=1), TernGrad(seed=2), Natural(seed=3)]


def z_score(n: int) -> float:
    """Standard errors that bound all ``n`` elements' deviations at once, except with prob. DELTA."""
    return math.sqrt(2 * math.log(2 * n / DELTA))


def mean_of_draws(compressor, x: torch.Tensor, draws: int = DRAWS, name: str = "w"):
    """The mean of ``draws`` decodes of ``x`` at successive steps, and the decodes themselves, one
    row per draw (flat, float64)."""
    total = torch.zeros(x.numel(), dtype=torch.float64)
    decoded = []
    for _ in range(draws):
        out = compressor.decompress(*compressor.compress(x, name)).reshape(-1).double()
        total += out
        decoded.append(out)
    return total / draws, torch.stack(decoded)


def assert_unbiased(mean: torch.Tensor, target: torch.Tensor, width: torch.Tensor, draws: int = DRAWS):
    n = target.numel()
    tolerance = z_score(n) * width / (2 * math.sqrt(draws))
    deviation = (mean - target).abs()
    worst = (deviation - tolerance).argmax()
    assert bool((deviation <= tolerance).all()), (
        f"element {int(worst)}: |mean - target| = {float(deviation[worst]):.3e} > {float(tolerance[worst]):.3e}")
    # A rounding rule's bias usually leans one way (toward larger or smaller magnitudes) on every
    # element; summed in units of each width, it grows like n while the noise grows like sqrt(n).
    # Hoeffding over all n * draws independent terms, each in an interval of width 1 / draws:
    drift = float((target.sign() * (mean - target) / width).sum())
    limit = math.sqrt(n * math.log(2 / DELTA) / (2 * draws))
    assert abs(drift) <= limit, f"deviations lean toward {'larger' if drift > 0 else 'smaller'} magnitudes: " \
                                f"{drift:.3f} widths in all, beyond {limit:.3f}"


def assert_mse_within(decoded: torch.Tensor, target: torch.Tensor, width: torch.Tensor, bound: float):
    """The mean over draws of ||Q - target||^2 is at most ``bound`` plus Hoeffding's slack."""
    errors = ((decoded - target) ** 2).sum(dim=1)
    slack = float((width**2).sum()) * math.sqrt(math.log(1 / DELTA) / (2 * decoded.shape[0]))
    assert float(errors.mean()) <= bound + slack, (float(errors.mean()), bound, slack)


def spread_vector(n: int, seed: int) -> torch.Tensor:
    """Gaussian signs and shapes over six decades of magnitude."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 6 - 3)


# -- QSGD -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [1, 4, 127])
def test_qsgd_is_unbiased_within_its_variance_bound(levels):
    x = spread_vector(64, seed=levels)
    compressor = QSGD(levels, seed=9)
    norm = float(compressor.compress(x, "probe")[0][0])
    mean, decoded = mean_of_draws(compressor, x)
    target = x.double()
    # Each element lies between two adjacent levels, norm / s apart.
    width = torch.full_like(target, norm / levels)
    assert_unbiased(mean, target, width)
    n = x.numel()
    bound = min(n / levels**2, math.sqrt(n) / levels) * float(target.norm()) ** 2
    assert_mse_within(decoded, target, width, bound)


def test_qsgd_levels_are_the_floor_or_ceiling_drawn_from_the_steps_own_key():
    x = spread_vector(300, seed=1)
    compressor = QSGD(16, seed=5)
    compressor.set_rank(3)
    for step in range(3):
        (norm, signed), _ = compressor.compress(x, "layer.weight")
        exact = torch.linalg.vector_norm(x.double())
        # The norm is float32 rounded up: at least the exact one, and the next float32 down is below.
        assert norm.dtype == torch.float32 and norm.shape == (1,)
        assert float(norm) >= float(exact) > float(torch.nextafter(norm, torch.tensor(0.0)))
        ratio = x.double().abs() / float(norm) * 16
        u = uniform(derived_seed(5, 3, "layer.weight", step), 300)
        expected = ratio.floor() + (u.double() < ratio - ratio.floor()).double()
        assert torch.equal(signed.abs().double(), expected)
        assert torch.equal(signed, (x.sign() * signed.abs()).to(signed.dtype))


@pytest.mark.parametrize("levels,dtype", [(1, torch.int8), (127, torch.int8), (128, torch.int16),
                                          (32767, torch.int16), (32768, torch.int32),
                                          (MAX_LEVELS, torch.int32)])
def test_qsgd_sends_the_smallest_signed_integer_that_holds_its_levels(levels, dtype):
    assert level_dtype(levels) == dtype
    # An element equal to the norm needs level s exactly, the extreme of the dtype's range.
    x = torch.tensor([0.0, -3.0, 0.0])
    (norm, signed), ctx = QSGD(levels).compress(x, "w")
    assert signed.dtype == dtype and signed.tolist() == [0, -levels, 0] and float(norm) == 3.0
    assert torch.equal(QSGD(levels).decompress([norm, signed], ctx), x)


def test_qsgd_refuses_more_levels_than_int32_holds_naming_the_argument():
    with pytest.raises(ValueError, match=r"QSGD: levels must be an integer in \[1, 2147483647\], got 2147483648"):
        QSGD(MAX_LEVELS + 1)
    with pytest.raises(ValueError, match=r"Legacy\(values\[1\]\): levels must be an integer in \[1, 2147483647\]"):
        Legacy(QSGD(), by="layer", values=[4, 2**40], splits=[10])


@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=3), levels=st.integers(1, 70_000),
       dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_qsgd_decodes_within_one_level_of_the_input(shape, levels, dtype, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    compressor = QSGD(levels, seed=seed)
    payload, ctx = compressor.compress(x, "w")
    norm, signed = payload
    assert signed.dtype == level_dtype(levels) and int(signed.abs().max()) <= levels
    assert compressor.payload_spec(x.numel(), dtype) == [(p.numel(), p.dtype) for p in payload]
    out = compressor.decompress(payload, ctx)
    assert out.shape == x.shape and out.dtype == dtype
    step = float(norm) / levels
    # The decoded value is computed in float32/64 and rounded once to the gradient's dtype.
    rounding = torch.finfo(dtype).eps * out.double().abs()
    assert bool(((out.double() - x.double()).abs() <= step + rounding + 1e-30).all())
    assert bool((out.double() * x.double() >= 0).all())


def test_qsgd_with_more_levels_than_float32_counts_works_in_float64():
    x = torch.tensor([1.0, -1e-3, 0.5, 0.25])
    compressor = QSGD(MAX_LEVELS)
    (norm, signed), ctx = compressor.compress(x, "w")
    assert ctx.work == torch.float64 and signed.dtype == torch.int32
    assert bool((compressor.decompress([norm, signed], ctx) - x).abs().max() <= float(norm) / MAX_LEVELS * 1.0001)


# -- TernGrad -------------------------------------------------------------------------------------


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


# -- Natural compression --------------------------------------------------------------------------


def natural_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^a, 2^(a+1)) around each |x| with 2^a <= |x| < 2^(a+1), from Python's frexp."""
    lows = [math.ldexp(1.0, math.frexp(v)[1] - 1) for v in x.reshape(-1).double().abs().tolist()]
    low = torch.tensor(lows, dtype=torch.float64)
    return low, 2 * low


def test_natural_is_unbiased_within_its_variance_bound():
    x = spread_vector(64, seed=3)
    compressor = Natural(seed=8)
    mean, decoded = mean_of_draws(compressor, x)
    low, high = natural_neighbours(x)
    target = x.double()
    assert_unbiased(mean, target, high - low)
    assert_mse_within(decoded, target, high - low, float((target**2).sum()) / 8)


def test_natural_rounds_to_one_of_the_two_neighbouring_powers_of_two_with_the_right_sign():
    x = spread_vector(500, seed=4)
    low, high = natural_neighbours(x)
    compressor = Natural()
    for _ in range(3):
        out = compressor.decompress(*compressor.compress(x, "w")).double()
        assert bool(((out.abs() == low) | (out.abs() == high)).all())
        assert torch.equal(out.sign(), x.double().sign())


def test_natural_byte_layout():
    x = torch.tensor([0.0, 1.0, -1.0, 0.25, -2.0**-20, float("nan"), float("-inf"), -0.0])
    (top, codes), ctx = Natural().compress(x, "w")
    # The largest finite |x| is 1 = 2^0, so top = 1 and code c means 2^(c - 126).
    assert top.dtype == torch.int16 and top.tolist() == [1]
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [0x00, 126, 0x80 | 126, 124, 0x80 | 106, 0x80, 0x80, 0x00]
    out = Natural().decompress([top, codes], ctx)
    assert torch.equal(out[[0, 1, 2, 3, 4, 7]], torch.tensor([0.0, 1.0, -1.0, 0.25, -2.0**-20, 0.0]))
    assert bool(out[5:7].isnan().all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_natural_elements_below_the_range_go_to_zero_or_its_bottom_without_bias(dtype):
    # The top element 1.0 = 2^0 puts the range at 2^-125 .. 2^1; the rest lie below it.
    bottom = 2.0**-125
    x = torch.tensor([1.0, 0.3 * bottom, 0.75 * bottom, -0.5 * bottom, 2.0**-140], dtype=torch.float64).to(dtype)
    mean, decoded = mean_of_draws(Natural(seed=1), x)
    assert set(decoded[:, 1:].abs().unique().tolist()) == {0.0, bottom}
    assert_unbiased(mean, x.double(), torch.tensor([1.0, bottom, bottom, bottom, bottom], dtype=torch.float64))


@pytest.mark.parametrize("dtype", FLOATS)
def test_natural_keeps_subnormals_and_powers_of_two_exact(dtype):
    info = torch.finfo(dtype)
    # Powers of two never round up; all within the 127 binades under the largest, 64 * tiny.
    tiny = info.smallest_normal
    x = torch.tensor([tiny, -tiny / 4, 64 * tiny, -tiny * info.eps], dtype=torch.float64).to(dtype)
    assert bool((x[[1, 3]] != 0).all())
    compressor = Natural()
    assert torch.equal(compressor.decompress(*compressor.compress(x, "w")), x)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("top", [-1100, -160, -20, 0, 1, 16, 130, 1030])
def test_natural_decodes_every_code_byte_as_documented(dtype, top):
    """The decode table against the documented meaning of each of the 256 codes."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    codes = torch.arange(256, dtype=torch.uint8)
    ctx = Natural().compress(torch.ones(256, dtype=dtype), "w")[1]
    out = Natural().decompress([torch.tensor([top], dtype=torch.int16), codes], ctx)
    expected = []
    for code in range(256):
        magnitude = code & 0x7F
        if code == 0x80:
            expected.append(math.nan)
        elif magnitude == 0:
            expected.append(0.0)
        else:
            power = math.ldexp(1.0, top - 127 + magnitude) if top - 127 + magnitude <= 1023 else math.inf
            expected.append(-power if code & 0x80 else power)
    want = torch.tensor(expected, dtype=torch.float64).to(work).to(dtype)
    assert out.dtype == dtype
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pow2_is_exact_over_the_whole_exponent_range(dtype):
    info = torch.finfo(dtype)
    least = math.frexp(info.smallest_normal * info.eps)[1] - 1  # the smallest subnormal's exponent
    most = math.frexp(info.max)[1] - 1
    exponents = torch.arange(least - 3, most + 4)
    expected = [math.ldexp(1.0, int(k)) if k <= most else math.inf for k in exponents]
    assert torch.equal(pow2(exponents, dtype), torch.tensor(expected, dtype=torch.float64).to(dtype))


# -- common to all three --------------------------------------------------------------------------


@pytest.mark.parametrize("compressor", all_three(), ids=repr)
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
@pytest.mark.parametrize("dtype", FLOATS)
def test_payload_spec_describes_the_real_payload_and_its_bytes(compressor, numel, dtype):
    x = torch.randn(numel).to(dtype)
    payload, _ = compressor.compress(x, "w")
    spec = compressor.payload_spec(numel, dtype)
    assert spec == [(p.numel(), p.dtype) for p in payload]
    assert not compressor.additive and compressor.uniform_payload
    packed = wire.packed_size(payload, with_header=False)
    assert packed == wire.packed_size_of(spec, with_header=False) == bytes_sent(compressor, numel, dtype)
    assert packed == wire.pack(payload, with_header=False).numel()


@pytest.mark.parametrize("compressor,numel,expected", [
    (QSGD(4), 10, 16), (QSGD(128), 10, 24), (QSGD(40_000), 10, 48), (TernGrad(), 10, 16),
    (Natural(), 10, 16), (Natural(), 6, 8), (QSGD(4), 1, 8), (TernGrad(), 1000, 1008)])
def test_bytes_per_element_as_documented(compressor, numel, expected):
    assert bytes_sent(compressor, numel, torch.float32) == expected


@pytest.mark.parametrize("compressor", all_three(), ids=repr)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_zero_tensors_decode_to_zeros_of_the_same_shape_and_dtype(compressor, shape, dtype):
    x = torch.zeros(shape, dtype=dtype)
    out = compressor.decompress(*compressor.compress(x, "w"))
    assert out.shape == x.shape and out.dtype == dtype and torch.equal(out, x)


@pytest.mark.parametrize("compressor", all_three(), ids=repr)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_any_shape_and_float_dtype_round_trips_its_shape_and_dtype(compressor, shape, dtype):
    x = torch.randn(shape).to(dtype)
    payload, ctx = compressor.compress(x, "w")
    # Through the wire, as a gather would deliver it.
    buffer = wire.pack(payload, with_header=False)
    (received,) = wire.unpack_gathered(buffer, payload, 1, with_header=False, name="w")
    out = compressor.decompress(received, ctx)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out, compressor.decompress(payload, ctx))
    assert bool(out.isfinite().all())


@pytest.mark.parametrize("compressor", [QSGD(3), TernGrad()], ids=repr)
@pytest.mark.parametrize("dtype", FLOATS)
def test_single_elements_are_sent_exactly_by_the_scaled_quantizers(compressor, dtype):
    # float32 values: a float64 one that float32 cannot hold gets its scale rounded up instead.
    for x in (torch.tensor(-0.7), torch.tensor([2.5])):
        x = x.to(dtype)
        assert torch.equal(compressor.decompress(*compressor.compress(x, "w")), x)


@pytest.mark.parametrize("make", [lambda: QSGD(5), TernGrad, Natural])
def test_global_rng_is_untouched(make):
    compressor = make()
    inputs = [torch.randn(100), torch.randn(3, 3).double(), torch.randn(()).half()]
    before = torch.random.get_rng_state()
    for i, x in enumerate(inputs):
        compressor.decompress(*compressor.compress(x, f"t{i}"))
        compressor.compress(x, f"t{i}")
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("make", [lambda seed: QSGD(7, seed=seed), lambda seed: TernGrad(seed=seed),
                                  lambda seed: Natural(seed=seed)])
def test_draws_depend_on_seed_rank_name_and_step_only(make):
    x = spread_vector(256, seed=5)

    def payload(seed=0, rank=0, name="w", steps_before=0):
        compressor = make(seed)
        compressor.set_rank(rank)
        for _ in range(steps_before):
            compressor.compress(x, name)
        return compressor.compress(x, name)[0]

    def same(a, b):
        return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))

    reference = payload(rank=2, steps_before=1)
    assert same(reference, payload(rank=2, steps_before=1))
    assert not same(reference, payload(rank=1, steps_before=1))
    assert not same(reference, payload(rank=2, steps_before=0))
    assert not same(reference, payload(rank=2, steps_before=2))
    assert not same(reference, payload(seed=1, rank=2, steps_before=1))
    assert not same(reference, payload(name="v", rank=2, steps_before=1))
    # Steps are per tensor: compressing another tensor in between changes nothing.
    compressor = make(0)
    compressor.set_rank(2)
    compressor.compress(x, "w")
    compressor.compress(x, "other")
    assert same(reference, compressor.compress(x, "w")[0])


@pytest.mark.parametrize("make", [lambda: QSGD(6), TernGrad, Natural])
def test_aggregate_is_the_mean_of_every_ranks_decoded_payload(make):
    x = spread_vector(50, seed=6)
    payloads, decoded, ctx = [], [], None
    for rank in range(4):
        compressor = make()
        compressor.set_rank(rank)
        payload, ctx = compressor.compress(x * (rank + 1), "w")
        payloads.append(payload)
        decoded.append(compressor.decompress(payload, ctx))
    expected = (decoded[0] + decoded[1] + decoded[2] + decoded[3]) / 4
    assert torch.equal(make().aggregate(payloads, ctx, average=True), expected)
    assert torch.equal(make().aggregate(payloads, ctx, average=False), expected * 4)


@pytest.mark.parametrize("compressor", all_three(), ids=repr)
def test_non_finite_gradients_decode_to_nan_not_to_a_number(compressor):
    for bad in (float("nan"), float("inf")):
        x = torch.tensor([1.0, bad, -2.0])
        out = compressor.decompress(*compressor.compress(x, "w"))
        assert bool(out[1].isnan())


@pytest.mark.parametrize("compressor", all_three(), ids=repr)
def test_bad_tensors_are_refused_clearly(compressor):
    with pytest.raises(ValueError, match="empty tensor"):
        compressor.compress(torch.zeros(0, 3), "x")
    with pytest.raises(TypeError, match="floating point"):
        compressor.compress(torch.arange(10), "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        compressor.compress([1.0, 2.0], "x")
    with pytest.raises(TypeError, match="sparse"):
        compressor.compress(torch.eye(3).to_sparse(), "x")


@pytest.mark.parametrize("bad", [0, -1, 1.5, float("nan"), float("inf")])
def test_invalid_levels_name_the_argument(bad):
    with pytest.raises(ValueError, match=r"QSGD: levels must be an integer in \[1, 2147483647\]"):
        QSGD(bad)


@pytest.mark.parametrize("bad", ["4", True, [4], torch.tensor(4)])
def test_levels_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="QSGD: levels"):
        QSGD(bad)


def test_whole_float_levels_are_accepted_as_integers():
    assert QSGD(16.0).levels == 16 and isinstance(QSGD(16.0).levels, int)


@pytest.mark.parametrize("make", [lambda: QSGD(4, seed=1.5), lambda: TernGrad(seed="1"), lambda: Natural(seed=None),
                                  lambda: QSGD(4, seed=True)])
def test_seed_must_be_an_int(make):
    with pytest.raises(TypeError, match="seed must be an int"):
        make()


def test_qsgd_without_levels_needs_a_value_or_legacy():
    with pytest.raises(ValueError, match=r"QSGD\(\) was built without its levels.*Legacy"):
        Grace(QSGD())
    with pytest.raises(ValueError, match="without its levels"):
        QSGD().compress(torch.randn(4), "x")


@pytest.mark.parametrize("compressor", [TernGrad(), Natural()], ids=repr)
def test_knobless_quantizers_cannot_be_scheduled(compressor):
    with pytest.raises(ValueError, match="no parameter to schedule"):
        Legacy(compressor, by="layer", values=[None, 1], splits=[10])
    with pytest.raises(ValueError, match="no parameter to schedule"):
        compressor.with_value(2)


@pytest.mark.parametrize("compressor", [*all_three(), QSGD()], ids=repr)
def test_unbiased_quantizers_recommend_no_memory(compressor):
    assert isinstance(compressor.recommended_memory(), NoMemory)
    if compressor.value is not None or compressor.parameter is None:
        assert isinstance(Grace(compressor).memory, NoMemory)


def test_exported_from_the_package():
    for name in ("QSGD", "TernGrad", "Natural"):
        assert name in grace_legacy.__all__ and name in grace_legacy.compressors.__all__


# -- LEGACY ---------------------------------------------------------------------------------------


def rebuttal_schedule() -> Legacy:
    return Legacy(QSGD(), by="layer", values=[None, 256, 64, 16], splits=[600, 100_000, 1_000_000])


@pytest.mark.parametrize("numel,levels", [
    (1, None), (599, None), (600, 256), (601, 256), (99_999, 256), (100_000, 64), (999_999, 64),
    (1_000_000, 16), (1_000_001, 16)])
def test_legacy_qsgd_rebuttal_schedule_at_every_boundary(numel, levels):
    schedule = rebuttal_schedule()
    assert schedule.value_at(numel) == levels
    x = torch.zeros(numel)
    concrete = schedule.compressor_for(x, "w")
    if levels is None:
        assert concrete is None  # dense: Grace sends it with a plain allreduce
        assert bytes_sent(concrete, numel, torch.float32) == 4 * numel
        return
    assert isinstance(concrete, QSGD) and concrete.levels == levels
    assert concrete.payload_spec(numel, torch.float32) == [(1, torch.float32), (numel, level_dtype(levels))]
    per_element = 2 if levels == 256 else 1
    assert bytes_sent(concrete, numel, torch.float32) == -(-(4 + per_element * numel) // 8) * 8


def test_legacy_qsgd_compresses_with_the_scheduled_levels_and_shares_steps():
    schedule = rebuttal_schedule()
    small, mid = spread_vector(600, seed=7), spread_vector(100_000, seed=8)
    payload, ctx = schedule.compress(small, "a")
    assert payload[1].dtype == torch.int16 and int(payload[1].abs().max()) <= 256
    assert schedule.decompress(payload, ctx).shape == small.shape
    payload, _ = schedule.compress(mid, "b")
    assert payload[1].dtype == torch.int8 and int(payload[1].abs().max()) <= 64
    dense_payload, dense_ctx = schedule.compress(torch.ones(10), "c")
    assert torch.equal(schedule.decompress(dense_payload, dense_ctx), torch.ones(10))
    assert schedule.base.state_dict()["steps"] == {"a": 1, "b": 1}
    # The configured copy draws like a plain QSGD(256) at the same step.
    again = rebuttal_schedule()
    again.compress(small, "a")
    twin = QSGD(256)
    twin.compress(small, "a")
    assert torch.equal(again.compress(small, "a")[0][1], twin.compress(small, "a")[0][1])


def test_legacy_qsgd_rebuttal_schedule_from_the_reference_flags():
    schedule = Legacy.from_flags(QSGD(), "layer", "none,256,64,16", "600,100000,1000000")
    assert schedule.table == rebuttal_schedule().table == [[None, 256, 64, 16]]
    assert schedule.to_flags()["group_compressions"] == "none,256,64,16"


def test_legacy_rejects_invalid_levels_naming_the_entry():
    with pytest.raises(ValueError, match=r"Legacy\(values\[1\]\): levels must be an integer in \[1, 2147483647\]"):
        Legacy(QSGD(), by="layer", values=[None, 0], splits=[10])
    with pytest.raises(TypeError, match=r"Legacy\(values\[0\]\): levels"):
        Legacy(QSGD(), by="layer", values=["8", 4], splits=[10])
    with pytest.raises(ValueError, match="levels=4 would be ignored"):
        Legacy(QSGD(4), by="layer", values=[None, 8], splits=[10])
