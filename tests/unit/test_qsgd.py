"""QSGD (``compressors/qsgd.py``): unbiased within its variance bound, each level the floor or
ceiling of its ratio drawn from the step's own key, the norm rounded up to float32, the smallest
signed integer that holds the levels, decoded within one level of the input (in float64 beyond
float32's integers); the levels' checks; and under LEGACY, the rebuttal's size groups (dense,
s=256, 64, 16) at every boundary, from the reference flags too, with steps shared by the copies."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import QSGD, Grace, Legacy
from grace_legacy.compressors.kernels.draws import uniform
from grace_legacy.compressors.qsgd import MAX_LEVELS, level_dtype
from grace_legacy.core.seeds import derived_seed
from grace_legacy.runtime.cost import bytes_sent
from tests.unit.test_quantization import FLOATS, assert_mse_within, assert_unbiased, mean_of_draws, spread_vector


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


def test_qsgd_without_levels_needs_a_value_or_legacy():
    with pytest.raises(ValueError, match=r"QSGD\(\) was built without its levels.*Legacy"):
        Grace(QSGD())
    with pytest.raises(ValueError, match="without its levels"):
        QSGD().compress(torch.randn(4), "x")


# -- under LEGACY ---------------------------------------------------------------------------------


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
