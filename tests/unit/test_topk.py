"""Top-k (``compressors/topk.py``): exactly the k largest magnitudes, decoded in place and zero
elsewhere, any shape and float dtype, and an aggregate equal to the sum of the decoded payloads.
The selection's fast path itself is in ``test_selection.py``."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import TopK
from grace_legacy.compressors.entries import kept_count


def distinct_magnitudes(n: int, seed: int = 0) -> torch.Tensor:
    """Random signs on a permutation of distinct magnitudes: top-k has no ties."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(n, generator=g).float() + 1.0
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return magnitudes * signs


@given(n=st.integers(1, 3000), ratio=st.floats(1e-4, 1.0), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_topk_keeps_exactly_the_k_largest_magnitudes(n, ratio, seed):
    x = distinct_magnitudes(n, seed)
    payload, ctx = TopK(ratio).compress(x, "x")
    values, indices = payload
    k = kept_count(ratio, n)
    assert values.numel() == indices.numel() == k
    assert indices.dtype == torch.int32 and values.dtype == x.dtype
    expected = set(torch.sort(x.abs(), descending=True).indices[:k].tolist())
    assert set(indices.tolist()) == expected
    restored = TopK(ratio).decompress(payload, ctx)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[list(expected)] = True
    assert torch.equal(restored[mask], x[mask])
    assert torch.count_nonzero(restored[~mask]) == 0


@pytest.mark.parametrize("shape", [(), (1,), (3, 4), (2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_topk_round_trips_any_shape_and_float_dtype(shape, dtype):
    x = torch.randn(shape).to(dtype)
    compressor = TopK(0.5)
    out = compressor.decompress(*compressor.compress(x, "x"))
    assert out.shape == x.shape and out.dtype == dtype


def test_topk_aggregate_equals_sum_of_decompressed():
    c = TopK(0.1)
    tensors = [torch.randn(50, 3) for _ in range(4)]
    compressed = [c.compress(t, "w") for t in tensors]
    ctx = compressed[0][1]
    expected = sum(c.decompress(p, ctx) for p, _ in compressed) / 4
    assert torch.allclose(c.aggregate([p for p, _ in compressed], ctx, average=True), expected, rtol=0, atol=1e-7)
