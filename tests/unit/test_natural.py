"""Natural compression (``compressors/natural.py``): unbiased within its variance bound, each
element rounded to one of its two neighbouring powers of two with its sign, the byte layout and
every code byte's documented meaning, elements below the range sent as zero or its bottom without
bias, subnormals and powers of two kept exactly, ``pow2`` exact over the whole exponent range."""

import math

import pytest
import torch

from grace_legacy import Natural
from grace_legacy.compressors.kernels.natural_passes import pow2
from tests.unit.test_quantization import FLOATS, assert_mse_within, assert_unbiased, mean_of_draws, spread_vector


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
