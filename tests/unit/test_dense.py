"""The uncompressed compressors (``compressors/dense.py``): FP16 and BF16 round-trip as plain casts,
keep dtype and shape, reuse their large output only once the caller let go, refuse sparse layouts;
BF16 equals its independent reference (``tests/reference_compressors.py``) and keeps fp32's
range; NoCompression is lossless and additive."""

import pytest
import torch

from grace_legacy import BF16, FP16, NoCompression
from tests.reference_compressors import CONTENTS, DTYPES, BF16Reference, assert_matches_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fp16_round_trip_keeps_dtype_and_shape_and_equals_plain_casts(dtype):
    x = torch.randn(3, 5, dtype=torch.float64).to(dtype)
    payload, ctx = FP16().compress(x, "x")
    assert payload[0].dtype == torch.float16
    assert torch.equal(payload[0], x.to(torch.float16))
    out = FP16().decompress(payload, ctx)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, x.to(torch.float16).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_bf16_rounds_to_nearest_bfloat16_and_back(dtype):
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(1000, generator=g, dtype=torch.float64)
         * torch.pow(10.0, torch.randint(-12, 3, (1000,), generator=g).double())).to(dtype)
    payload, ctx = BF16().compress(x, "x")
    assert payload[0].dtype == torch.bfloat16 and torch.equal(payload[0], x.to(torch.bfloat16))
    out = BF16().decompress(payload, ctx)
    assert out.dtype == dtype and torch.equal(out, x.to(torch.bfloat16).to(dtype))
    if dtype == torch.bfloat16:
        assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("content", CONTENTS)
def test_bf16_payload_and_decoded_values_equal_the_reference(content, dtype):
    assert_matches_reference(BF16(), BF16Reference(), content, dtype, "BF16")


def test_bf16_keeps_fp32s_range_where_fp16_does_not():
    x = torch.tensor([3e38, -1e30, 1e-30, 1e-38])
    assert torch.isfinite(BF16().decompress(*BF16().compress(x, "x"))).all()
    assert (BF16().decompress(*BF16().compress(x, "x")) != 0).all()
    assert not torch.isfinite(FP16().decompress(*FP16().compress(x, "x"))).all()


@pytest.mark.parametrize("compressor", [FP16, BF16])
def test_a_large_output_is_reused_only_once_the_caller_let_go(compressor):
    from grace_legacy.runtime.buffers import MMAP_CEILING

    compressor = compressor()
    x = torch.randn(MMAP_CEILING // 4 // 64 + 1, 64)
    cast = compressor.wire_dtype
    first = compressor.decompress(*compressor.compress(x, "x"))
    held = first.data_ptr()
    second = compressor.decompress(*compressor.compress(-x, "x"))
    assert second.data_ptr() != held, "a result still held was overwritten"
    assert torch.equal(first, x.to(cast).float()) and torch.equal(second, (-x).to(cast).float())
    kept = {held, second.data_ptr()}
    del first, second
    third = compressor.decompress(*compressor.compress(2 * x, "x"))
    assert torch.equal(third, (2 * x).to(cast).float())
    assert third.data_ptr() in kept, "the kept buffers, which nobody held any more, were not used again"


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("compressor", [FP16, BF16])
def test_a_16_bit_cast_rejects_every_sparse_layout(layout, compressor):
    bad = torch.eye(3).to_sparse() if layout == "coo" else torch.eye(3).to_sparse_csr()
    with pytest.raises(TypeError, match="sparse"):
        compressor().compress(bad, "x")


def test_no_compression_is_lossless_and_additive():
    x = torch.randn(7)
    c = NoCompression()
    assert c.traits.lossless and c.traits.additive
    assert c.decompress(*c.compress(x, "x")) is x
