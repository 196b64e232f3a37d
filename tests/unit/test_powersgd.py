import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import Grace, Legacy, PowerSGD, PowerSGDMemory
from grace_legacy.runtime.cost import bytes_sent


def one_worker_step(compressor: PowerSGD, matrix: torch.Tensor, name: str = "w") -> torch.Tensor:
    """Both rounds on a single worker: the 'sums' are this worker's own payloads."""
    (p,), ctx = compressor.compress(matrix, name)
    (q,), ctx = compressor.next_round([p], ctx)
    compressor.end_exchange([q], ctx)
    return compressor.decompress([q], ctx)


@given(n=st.integers(8, 40), m=st.integers(8, 40), true_rank=st.integers(1, 3), extra=st.integers(0, 2),
       seed=st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_rank_at_least_the_true_rank_reconstructs_a_low_rank_matrix(n, m, true_rank, extra, seed):
    g = torch.Generator().manual_seed(seed)
    matrix = torch.randn(n, true_rank, generator=g, dtype=torch.float64) @ torch.randn(true_rank, m, generator=g,
                                                                                        dtype=torch.float64)
    rank = true_rank + extra
    if (n + m) * rank >= n * m:
        return
    out = one_worker_step(PowerSGD(rank), matrix)
    torch.testing.assert_close(out, matrix, rtol=1e-9, atol=1e-9)


def test_warm_start_converges_on_a_full_rank_matrix():
    torch.manual_seed(0)
    matrix = torch.randn(60, 50, dtype=torch.float64)
    best = torch.linalg.svdvals(matrix)
    optimal_error = best[2:].pow(2).sum().sqrt()
    compressor = PowerSGD(2)
    errors = [(one_worker_step(compressor, matrix) - matrix).norm() for _ in range(30)]
    assert errors[-1] < errors[0]
    assert errors[-1] <= optimal_error * 1.01  # power iteration reaches the best rank-2 approximation


def test_what_goes_dense():
    c = PowerSGD(4)
    assert c.compressor_for(torch.zeros(100), "bias") is None
    assert c.compressor_for(torch.zeros(()), "scalar") is None
    assert c.compressor_for(torch.zeros(6, 6), "small") is None          # (6 + 6) * 4 >= 36
    assert c.compressor_for(torch.zeros(20, 3, 3), "conv") is c          # 20 x 9: (20 + 9) * 4 < 180
    with pytest.raises(ValueError, match="sent dense"):
        c.compress(torch.zeros(10), "bias")


def test_legacy_keeps_the_base_rule_for_what_goes_dense():
    schedule = Legacy(PowerSGD(), by="epoch", values=[6, 2], epochs=2)
    assert schedule.compressor_for(torch.zeros(100), "bias") is None
    assert schedule.compressor_for(torch.zeros(8, 8), "m") is None       # (8 + 8) * 6 >= 64: dense in phase 0
    schedule.set_epoch(1)
    assert schedule.compressor_for(torch.zeros(8, 8), "m").rank_r == 2


def test_rank_change_redraws_q_and_state_round_trips():
    c = PowerSGD(3, seed=1)
    x = torch.randn(20, 10)
    one_worker_step(c, x)
    assert c.state_dict()["warm_q"]["w"].shape == (10, 3)
    lower = c.with_value(2)
    one_worker_step(lower, x)
    assert c.state_dict()["warm_q"]["w"].shape == (10, 2)  # shared with the copy
    restored = PowerSGD(2, seed=1)
    restored.load_state_dict(lower.state_dict())
    assert torch.equal(one_worker_step(restored, x), one_worker_step(lower, x))


def test_half_precision_is_factored_in_fp32_and_returned_in_its_dtype():
    x = torch.randn(16, 12).to(torch.bfloat16)
    c = PowerSGD(2)
    (p,), _ = c.compress(x, "w")
    assert p.dtype == torch.float32
    assert one_worker_step(PowerSGD(2), x).dtype == torch.bfloat16


def test_never_touches_the_global_rng_and_first_q_is_shared_by_ranks():
    x = torch.randn(20, 10)
    before = torch.random.get_rng_state()
    a, b = PowerSGD(2, seed=9), PowerSGD(2, seed=9)
    b.set_rank(3)
    (pa,), _ = a.compress(x, "w")
    (pb,), _ = b.compress(x, "w")
    assert torch.equal(pa, pb)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_bytes_and_memory():
    c = PowerSGD(2)
    assert bytes_sent(c, (30, 4, 5), torch.float32) == 4 * (30 + 20) * 2
    assert isinstance(Grace(c).memory, PowerSGDMemory)


@pytest.mark.parametrize("bad", [0, -1, 1.5, float("nan")])
def test_invalid_rank(bad):
    with pytest.raises(ValueError, match="PowerSGD: rank must be an integer >= 1"):
        PowerSGD(bad)


@pytest.mark.parametrize("shape", [(64, 3, 3, 3), (300, 40), (40, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_second_round_sends_the_matrix_transposed_times_the_orthonormal_basis(shape, dtype):
    """Q_w = M_w^T P^, computed as (P^T M)^T for speed: the same matrix, contiguous."""
    compressor = PowerSGD(4)
    grad = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    payload, ctx = compressor.compress(grad, "w")
    (q,), ctx = compressor.next_round(payload, ctx)
    assert q.is_contiguous() and q.dtype == dtype
    matrix = grad.reshape(shape[0], -1)
    torch.testing.assert_close(q, matrix.t() @ ctx.p_hat)
    torch.testing.assert_close(ctx.p_hat.t() @ ctx.p_hat, torch.eye(4, dtype=dtype))


def test_a_large_output_is_reused_only_once_the_caller_let_go():
    """Above glibc's mmap ceiling a fresh output costs a page fault per page: PowerSGD keeps it,
    but never overwrites a result its caller still holds."""
    from grace_legacy.compressors.kernels import products
    from grace_legacy.runtime.buffers import MMAP_CEILING

    compressor = PowerSGD(2)

    def round_trip(tensor):
        payload, ctx = compressor.compress(tensor, "w")
        payload, ctx = compressor.next_round(payload, ctx)  # one rank: the payload is its own sum
        want = products.times_transposed(ctx.p_hat, payload[0]).reshape(tensor.shape)
        return compressor.decompress(payload, ctx), want

    x = torch.randn(MMAP_CEILING // 4 // 64 + 1, 64, generator=torch.Generator().manual_seed(0))
    first, want_first = round_trip(x)
    second, want_second = round_trip(-x)
    assert second.data_ptr() != first.data_ptr(), "a result still held was overwritten"
    assert torch.equal(first, want_first) and torch.equal(second, want_second)
    kept = {first.data_ptr(), second.data_ptr()}
    del first, second, want_second
    third, want_third = round_trip(2 * x)
    assert torch.equal(third, want_third)
    assert third.data_ptr() in kept, "the kept buffers, which nobody held any more, were not used again"


def _times_in_documented_order(matrix: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``matrix @ q`` in products.py's order: LANES interleaved sums, then folded in halves."""
    from grace_legacy.compressors.kernels.products import LANES

    sums = torch.zeros(matrix.shape[0], q.shape[1], LANES, dtype=matrix.dtype)
    for start in range(0, matrix.shape[1], LANES):
        width = min(LANES, matrix.shape[1] - start)
        sums[:, :, :width] += matrix[:, None, start:start + width] * q.t()[None, :, start:start + width]
    half = LANES // 2
    while half:
        sums[:, :, :half] += sums[:, :, half:2 * half]
        half //= 2
    return sums[:, :, 0]


def _transposed_times_in_documented_order(p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``p.t() @ matrix``, adding each row's products in order."""
    out = torch.zeros(p.shape[1], matrix.shape[1], dtype=matrix.dtype)
    for i in range(matrix.shape[0]):
        out += p[i, :, None] * matrix[i]
    return out


def _times_transposed_in_documented_order(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``p @ q.t()``, adding each element's products one by one in k's order."""
    out = p[:, :1] * q[:, 0]
    for k in range(1, p.shape[1]):
        out = out + p[:, k:k + 1] * q[:, k]
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_products_keep_their_documented_orders(threads, dtype, monkeypatch):
    """Each compiled product gives the bits of the order products.py documents, for every rank r
    (decoding adds two products a pass: pairs and a lone last one), rows shorter and longer than
    the lanes of M Q with a ragged last stretch, and on two threads' blocks; the residual
    subtracts the decoded row in the same loop."""
    from grace_legacy.compressors.kernels import compiled, products

    monkeypatch.setattr(compiled, "PER_THREAD", compiled.BLOCK)  # two threads for a few blocks
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, m in [(1, 1), (3, 7), (5, 64), (10, 131), (513, 131), (5, 3 * compiled.BLOCK // 5 + 3)]:
            for r in range(1, 7):
                g = torch.Generator().manual_seed(97 * n + r)
                p, q, matrix = (torch.randn(shape, generator=g, dtype=dtype) for shape in ((n, r), (m, r), (n, m)))
                assert torch.equal(products.matrix_times(matrix, q), _times_in_documented_order(matrix, q))
                if n < 100:  # the reference adds row by row
                    assert torch.equal(products.transposed_times(p, matrix),
                                       _transposed_times_in_documented_order(p, matrix))
                want = _times_transposed_in_documented_order(p, q)
                assert torch.equal(products.times_transposed(p, q), want), (n, m, r)
                assert torch.equal(products.minus_times_transposed(matrix, p, q), matrix - want), (n, m, r)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="minus_times_transposed: matrix must be 2 x 3"):
        products.minus_times_transposed(torch.zeros(3, 2, dtype=dtype), torch.zeros(2, 1, dtype=dtype),
                                        torch.zeros(3, 1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_the_residual_is_the_decoded_payload_subtracted(dtype):
    """PowerSGDMemory keeps M - P^ Q_w^T from one pass (PowerSGD.subtract_decoded): bit for bit
    Residual's rule, decode then subtract (which fp16 gradients, decoded with a cast, still take)."""
    from grace_legacy import Residual

    grad = torch.randn(40, 3, 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    kept, decoded = {}, []
    for memory in (PowerSGDMemory(), Residual()):
        compressor = PowerSGD(3)
        decode = compressor.decompress
        compressor.decompress = (lambda payload, ctx, memory=memory, decode=decode:
                                 decoded.append(memory) or decode(payload, ctx))
        for step in range(2):  # the second step compensates with the first's residual
            compensated = memory.compensate(grad * (step + 1), "w")
            payload, ctx = compressor.compress(compensated, "w")
            payload, ctx = compressor.next_round(payload, ctx)
            memory.update(compensated, "w", compressor, payload, ctx)
            compressor.end_exchange(payload, ctx)
            memory.end_step()
            compressor.end_step()
        kept[type(memory).__name__] = memory.residuals["w"]
    assert kept["PowerSGDMemory"].dtype == dtype and kept["PowerSGDMemory"].shape == grad.shape
    assert torch.equal(kept["PowerSGDMemory"], kept["Residual"])
    one_pass = dtype != torch.float16
    assert sum(isinstance(m, PowerSGDMemory) for m in decoded) == (0 if one_pass else 2)


def test_decompress_into_writes_the_decoded_bits_where_it_is_told():
    compressor = PowerSGD(2)
    grad = torch.randn(30, 4, 5, generator=torch.Generator().manual_seed(4))
    payload, ctx = compressor.compress(grad, "w")
    payload, ctx = compressor.next_round(payload, ctx)
    want = compressor.decompress(payload, ctx).clone()
    out = torch.empty_like(grad)
    assert compressor.decompress_into(payload, ctx, out) is out and torch.equal(out, want)
    # Where the result would be cast, or the storage is not one run, it declines: decompress runs.
    assert compressor.decompress_into(payload, ctx, torch.empty_like(grad, dtype=torch.float64)) is None
    assert compressor.decompress_into(payload, ctx, torch.empty(5, 4, 30).permute(2, 1, 0)) is None


@pytest.mark.parametrize("world", [1, 3])
def test_a_bucket_decoded_in_place_equals_one_decoded_apart(world):
    """The DDP hook starts each gradient ``in_place``: PowerSGD's compensated gradient is built in
    the gradient's own place in the bucket and its result decoded there (no buffer, no copy
    afterwards), the tensors sent dense come back as before, and every value and residual equals
    those of a bundle that uses buffers of its own, step after step (error feedback and the warm
    start read nothing the decoding overwrote)."""
    from tests.helpers import bucket_of, run_ranks

    shapes = {"a.weight": (12, 3, 3), "a.bias": (12,), "b.weight": (7, 40)}

    def body(backend, in_place):
        bundle = Grace(PowerSGD(2))
        steps = []
        for step in range(3):
            grads = [torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + 10 * backend.rank() + i))
                     for i, shape in enumerate(shapes.values())]
            _, views = bucket_of(grads)  # the views keep the bucket's storage
            residuals = {n: bundle.memory.residuals[n].clone() for n in bundle.memory.residuals}
            started = {n: bundle.start(v, n, backend, average=True, hold=True, in_place=in_place)
                       for n, v in zip(shapes, views, strict=True)}
            for n, v, g in zip(shapes, views, grads, strict=True):  # g + e in the bucket, or g as it was
                assert torch.equal(v, g + residuals[n] if in_place and n in residuals else g), n
            assert step == 0 or set(residuals) == {"a.weight", "b.weight"}
            bundle.fusion.launch_held("b0", backend, average=True)
            results = {n: p() for n, p in started.items()}
            if in_place:
                for n, v in zip(shapes, views, strict=True):
                    assert (results[n].data_ptr() == v.data_ptr()) == n.endswith("weight"), n
            steps.append({**{n: r.clone() for n, r in results.items()},
                          **{f"residual of {n}": e.clone() for n, e in bundle.memory.residuals.items()}})
            bundle.end_step(backend)
        return steps

    apart = run_ranks(world, lambda backend: body(backend, False))
    decoded_in_place = run_ranks(world, lambda backend: body(backend, True))
    for mine, theirs in zip(decoded_in_place, apart, strict=True):
        for step_mine, step_theirs in zip(mine, theirs, strict=True):
            assert step_mine.keys() == step_theirs.keys()
            for name in step_mine:
                assert torch.equal(step_mine[name], step_theirs[name]), name
