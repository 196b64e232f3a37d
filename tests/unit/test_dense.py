"""The uncompressed compressors (``compressors/dense.py``): FP16 round-trips as plain casts, keeps
dtype and shape, reuses its large output only once the caller let go, refuses sparse layouts;
NoCompression is lossless and additive."""

import pytest
import torch

from grace_legacy import FP16, NoCompression


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fp16_round_trip_keeps_dtype_and_shape_and_equals_plain_casts(dtype):
    x = torch.randn(3, 5, dtype=torch.float64).to(dtype)
    payload, ctx = FP16().compress(x, "x")
    assert payload[0].dtype == torch.float16
    assert torch.equal(payload[0], x.to(torch.float16))
    out = FP16().decompress(payload, ctx)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, x.to(torch.float16).to(dtype))


def test_fp16_large_output_is_reused_only_once_the_caller_let_go():
    from grace_legacy.runtime.buffers import MMAP_CEILING

    compressor = FP16()
    x = torch.randn(MMAP_CEILING // 4 // 64 + 1, 64)
    first = compressor.decompress(*compressor.compress(x, "x"))
    held = first.data_ptr()
    second = compressor.decompress(*compressor.compress(-x, "x"))
    assert second.data_ptr() != held, "a result still held was overwritten"
    assert torch.equal(first, x.half().float()) and torch.equal(second, (-x).half().float())
    kept = second.data_ptr()
    del first, second
    third = compressor.decompress(*compressor.compress(2 * x, "x"))
    assert torch.equal(third, (2 * x).half().float())
    assert third.data_ptr() == kept, "the kept buffer, which nobody held any more, was not used again"


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_fp16_rejects_every_sparse_layout(layout):
    bad = torch.eye(3).to_sparse() if layout == "coo" else torch.eye(3).to_sparse_csr()
    with pytest.raises(TypeError, match="sparse"):
        FP16().compress(bad, "x")


def test_no_compression_is_lossless_and_additive():
    x = torch.randn(7)
    c = NoCompression()
    assert c.lossless and c.additive
    assert c.decompress(*c.compress(x, "x")) is x
