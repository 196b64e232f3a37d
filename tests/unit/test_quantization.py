"""What the unbiased stochastic quantizers (QSGD, TernGrad, natural compression) share
(``compressors/quantization.py``): ``payload_spec`` and the bytes on the wire, zero and single
elements, any shape and dtype through the wire, draws that depend on the seed, rank, tensor name
and step only (never on the global generator), the aggregate as the mean of every rank's decoded
payload, non-finite gradients decoded to NaN, argument checks and ``NoMemory`` recommended. Each
quantizer's own formula and unbiasedness are in ``test_qsgd.py``, ``test_terngrad.py`` and
``test_natural.py``, with the statistical checks defined here.

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

import grace_legacy
from grace_legacy import QSGD, Grace, Legacy, Natural, NoMemory, TernGrad
from grace_legacy.core.compressor import Tunable
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


@pytest.mark.parametrize("compressor", all_three(), ids=repr)
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
@pytest.mark.parametrize("dtype", FLOATS)
def test_payload_spec_describes_the_real_payload_and_its_bytes(compressor, numel, dtype):
    x = torch.randn(numel).to(dtype)
    payload, _ = compressor.compress(x, "w")
    spec = compressor.payload_spec(numel, dtype)
    assert spec == [(p.numel(), p.dtype) for p in payload]
    assert not compressor.traits.additive and compressor.traits.uniform_payload
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


@pytest.mark.parametrize("make", [lambda: QSGD(4, seed=1.5), lambda: TernGrad(seed="1"), lambda: Natural(seed=None),
                                  lambda: QSGD(4, seed=True)])
def test_seed_must_be_an_int(make):
    with pytest.raises(TypeError, match="seed must be an int"):
        make()


@pytest.mark.parametrize("compressor", [TernGrad(), Natural()], ids=repr)
def test_parameterless_quantizers_cannot_be_scheduled(compressor):
    with pytest.raises(ValueError, match="no parameter to schedule"):
        Legacy(compressor, by="layer", values=[None, 1], splits=[10])
    assert not isinstance(compressor, Tunable)


@pytest.mark.parametrize("compressor", [*all_three(), QSGD()], ids=repr)
def test_unbiased_quantizers_recommend_no_memory(compressor):
    assert isinstance(compressor.recommended_memory(), NoMemory)
    if not isinstance(compressor, Tunable) or compressor.value is not None:
        assert isinstance(Grace(compressor).memory, NoMemory)


def test_exported_from_the_package():
    for name in ("QSGD", "TernGrad", "Natural"):
        assert name in grace_legacy.__all__ and name in grace_legacy.compressors.__all__
