"""What the 1-bit compressors (SignSGD, Signum, EF-signSGD, 1-bit SGD) share
(``compressors/signs.py``): a payload of packed signs plus each one's few scalars, described by
``payload_spec`` and costed to the byte on the wire; non-finite and half-precision scalars carried
without overflow; any shape and dtype decoded back to it; bad tensors refused; their reprs.

Each compressor's own behaviour is in its file (``test_signsgd.py`` for SignSGD and Signum,
``test_efsignsgd.py``, ``test_onebit.py``), the bit packing in ``test_bits.py`` and the compiled
passes in ``test_sign_passes.py``; they share the helpers defined here."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import EFSignSGD, OneBit, SignSGD, Signum
from grace_legacy.runtime import wire
from grace_legacy.runtime.cost import bytes_sent

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(), (1,), (7,), (8,), (3, 5), (2, 3, 4, 5)]
shapes = st.lists(st.integers(1, 6), max_size=4).map(tuple)


def all_compressors():
    return [SignSGD(), Signum(0.9), EFSignSGD(0.1), OneBit()]


def tensor_of(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def vote_through(compressor, gradients, average=True):
    """What ``compressor`` aggregates from each gradient's payload (the ranks' exchange, in one process)."""
    compressed = [compressor.compress(g, "w") for g in gradients]
    return compressor.aggregate([p for p, _ in compressed], compressed[0][1], average)


def dyadic(seed: int, n: int, world: int) -> list[torch.Tensor]:
    """Multiples of 1/8 below 4 in magnitude: with n and lr powers of two, EF-signSGD is exact."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-32, 33, (n,), generator=g).float() / 8 for _ in range(world)]


@given(shape=shapes, dtype=st.sampled_from(DTYPES), which=st.integers(0, 3), seed=st.integers(0, 2**16))
@settings(max_examples=120, deadline=None)
def test_payload_is_packed_bits_plus_scalars_and_payload_spec_matches(shape, dtype, which, seed):
    compressor = all_compressors()[which]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    payload, ctx = compressor.compress(x, "w")
    n = x.numel()
    scalars = {SignSGD: 0, Signum: 0, EFSignSGD: 1, OneBit: 2}[type(compressor)]
    assert payload[0].dtype == torch.uint8 and payload[0].shape == (math.ceil(n / 8),)
    assert sum(p.numel() for p in payload[1:]) == scalars and all(p.dtype == dtype for p in payload[1:])
    assert compressor.payload_spec(n, dtype) == [(p.numel(), p.dtype) for p in payload]
    assert sum(p.numel() * p.element_size() for p in payload) == math.ceil(n / 8) + scalars * x.element_size()
    assert not compressor.traits.additive and compressor.traits.uniform_payload and not compressor.traits.lossless
    assert bytes_sent(compressor, n, dtype) == wire.packed_size(payload, with_header=False)


@pytest.mark.parametrize("compressor,dtype,n,expected", [
    (SignSGD(), torch.float32, 1, 8), (SignSGD(), torch.float32, 64, 8), (SignSGD(), torch.float32, 65, 16),
    (SignSGD(), torch.float32, 1000, 128),
    (EFSignSGD(0.1), torch.float32, 1, 8), (EFSignSGD(0.1), torch.float32, 70, 16),
    (EFSignSGD(0.1), torch.float64, 70, 24), (EFSignSGD(0.1), torch.float16, 70, 16),
    (OneBit(), torch.float32, 1, 16), (OneBit(), torch.float32, 70, 24), (OneBit(), torch.float32, 1000, 136),
])
def test_bytes_on_the_wire(compressor, dtype, n, expected):
    # bits at offset 0, then the scalars at the next multiple of their size, the whole padded to 8
    assert bytes_sent(compressor, n, dtype) == expected


# -- non-finite values, shapes, dtypes, bad tensors --------------------------------------------------


def test_scalars_carry_non_finite_values_on():
    ef, onebit = EFSignSGD(1.0), OneBit()
    assert torch.isinf(ef.compress(tensor_of([1.0, float("inf")]), "w")[0][1]).all()
    assert torch.isnan(ef.compress(tensor_of([1.0, float("nan")]), "w")[0][1]).all()
    means = onebit.compress(tensor_of([1.0, float("nan"), -1.0]), "w")[0][1]
    assert means[0].item() == 1.0 and math.isnan(means[1].item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_scalars_are_accumulated_without_overflow(dtype):
    big = torch.full((4,), 60000.0, dtype=dtype)
    assert torch.isfinite(EFSignSGD(1.0).compress(big, "w")[0][1]).all()
    assert torch.isfinite(OneBit().compress(torch.cat([big, -big]), "w")[0][1]).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", range(4))
def test_any_shape_and_dtype_decodes_to_the_input_shape_and_dtype(which, shape, dtype):
    compressor = all_compressors()[which]
    x = torch.randn(shape).to(dtype)
    payload, ctx = compressor.compress(x, "w")
    out = compressor.decompress(payload, ctx)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out >= 0, x >= 0)  # every compressor keeps the bit x >= 0
    agg = compressor.aggregate([payload, payload], ctx, True)
    assert agg.shape == x.shape and agg.dtype == dtype


@pytest.mark.parametrize("which", range(4))
def test_bad_tensors_are_refused_clearly(which):
    compressor = all_compressors()[which]
    with pytest.raises(ValueError, match="empty tensor"):
        compressor.compress(torch.zeros(0, 3), "x")
    with pytest.raises(TypeError, match="floating point"):
        compressor.compress(torch.arange(10), "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        compressor.compress([1.0, 2.0], "x")
    with pytest.raises(TypeError, match="sparse"):
        compressor.compress(torch.eye(3).to_sparse(), "x")
    with pytest.raises(TypeError, match="must be float32, float64, float16 or bfloat16, got torch.float8"):
        compressor.compress(torch.ones(3).to(torch.float8_e4m3fn), "x")


def test_reprs():
    assert [repr(c) for c in all_compressors()] == ["SignSGD()", "Signum(momentum=0.9)", "EFSignSGD(lr=0.1)",
                                                    "OneBit()"]
