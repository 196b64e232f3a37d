import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import FP16, Allgather, Allreduce, Grace, NoCompression, NoMemory, RandomK, Residual, TopK


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


@given(steps=st.lists(st.integers(0, 2**16), min_size=1, max_size=5), n=st.integers(1, 400),
       ratio=st.floats(0.01, 1.0), use_randomk=st.booleans())
@settings(max_examples=60, deadline=None)
def test_residual_keeps_sent_plus_new_residual_equal_to_gradient_plus_old_residual(steps, n, ratio, use_randomk):
    compressor = RandomK(ratio, seed=1) if use_randomk else TopK(ratio)
    memory = Residual()
    for seed in steps:
        g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        old = memory.residuals.get("w", torch.zeros(n)).clone()
        compensated = memory.compensate(g, "w")
        payload, ctx = compressor.compress(compensated, "w")
        memory.update(compensated, "w", compressor, payload, ctx)
        sent = compressor.decompress(payload, ctx)
        assert torch.equal(sent + memory.residuals["w"], g + old)


def test_residual_forgets_a_tensor_sent_losslessly():
    memory = Residual()
    memory.residuals["w"] = torch.ones(3)
    compensated = memory.compensate(torch.ones(3), "w")
    assert torch.equal(compensated, torch.full((3,), 2.0))
    memory.update(compensated, "w", NoCompression(), [compensated], None)
    assert "w" not in memory.residuals


def test_residual_state_dict_round_trip_is_a_copy():
    memory = Residual()
    memory.residuals["w"] = torch.arange(4.0)
    state = memory.state_dict()
    memory.residuals["w"] += 1
    restored = Residual()
    restored.load_state_dict(state)
    assert torch.equal(restored.residuals["w"], torch.arange(4.0))


def test_residual_rejects_a_tensor_that_changed_shape():
    memory = Residual()
    memory.residuals["w"] = torch.zeros(3)
    with pytest.raises(ValueError, match="changed from"):
        memory.compensate(torch.zeros(4), "w")


def test_grace_defaults_and_validation():
    assert isinstance(Grace(TopK(0.1)).memory, Residual)
    assert isinstance(Grace(FP16()).memory, NoMemory)
    with pytest.raises(ValueError, match="non-additive"):
        Grace(TopK(0.1), communicator=Allreduce())
    Grace(TopK(0.1), communicator=Allgather())
    Grace(RandomK(0.1), communicator=Allreduce())
    with pytest.raises(TypeError, match="compressor must be"):
        Grace("topk")
    with pytest.raises(TypeError, match="memory must be"):
        Grace(TopK(0.1), memory=TopK(0.1))
