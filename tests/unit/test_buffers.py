"""Buffers used again across steps (``runtime/buffers.py``): a buffer is handed out again, zeroed,
only once nothing outside grace_legacy refers to its memory (a view, a ``.grad``, ``set_``, numpy,
a memoryview, a storage); other sizes, dtypes and small buffers get new ones; a fused bucket's
results kept by the caller stay as they were while dropped ones make room, and a decoded tensor
the caller keeps is never overwritten by the next."""

import numpy as np
import pytest
import torch

from grace_legacy import Grace, Residual, TopK
from grace_legacy.compressors import entries
from grace_legacy.runtime import buffers as recycle
from grace_legacy.runtime.buffers import BufferPool
from tests.helpers import run_ranks


def hold_view(buffer):
    return buffer[3:7]


def hold_grad(buffer):
    parameter = torch.nn.Parameter(torch.zeros(4))
    parameter.grad = buffer[:4]
    return parameter


def hold_set(buffer):
    return torch.empty(0).set_(buffer[2:6])


N = 4096
CPU = torch.device("cpu")

HOLDERS = {
    "view": hold_view,
    "grad": hold_grad,
    "set_": hold_set,
    "numpy": lambda buffer: buffer[1:].numpy(),
    "memoryview": lambda buffer: memoryview(buffer.numpy()),
    "np.asarray": lambda buffer: np.asarray(buffer),
    "storage": lambda buffer: buffer[5:].untyped_storage(),
}


def test_a_buffer_nobody_else_holds_is_zeroed_and_handed_out_again():
    recycler = BufferPool()
    first = recycler.zeros("b", N, torch.float32, CPU)
    pointer = first.data_ptr()
    first.fill_(3.0)
    del first
    again = recycler.zeros("b", N, torch.float32, CPU)
    assert again.data_ptr() == pointer
    assert torch.equal(again, torch.zeros(N))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_zeroed_clears_every_element_to_positive_zero(dtype):
    buffer = torch.full((N + 3,), -0.0 if dtype.is_floating_point else -7, dtype=dtype)
    assert recycle.zeroed(buffer) is buffer
    assert torch.equal(buffer.view(torch.uint8), torch.zeros(buffer.numel() * buffer.element_size(),
                                                             dtype=torch.uint8))


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_a_buffer_the_caller_still_refers_to_is_never_overwritten(holder):
    recycler = BufferPool()
    buffer = recycler.zeros("b", N, torch.float32, CPU)
    buffer.copy_(torch.arange(float(N)))
    kept = HOLDERS[holder](buffer)
    pointer = buffer.data_ptr()
    del buffer
    fresh = recycler.zeros("b", N, torch.float32, CPU).view(N)  # a view, as the library hands them on
    assert fresh.data_ptr() != pointer
    assert torch.equal(fresh, torch.zeros(N))
    third = recycler.zeros("b", N, torch.float32, CPU).view(N)  # both kept ones are held: a new one
    assert third.data_ptr() not in (pointer, fresh.data_ptr())
    del kept  # its memory held arange all along; now it may be handed out again, zeroed
    fresh.fill_(1.0)
    pointers = {fresh.data_ptr(), third.data_ptr()}
    del fresh, third
    again = recycler.zeros("b", N, torch.float32, CPU)
    assert again.data_ptr() in pointers and torch.equal(again, torch.zeros(N))  # at most DEPTH kept


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_an_uninitialised_buffer_follows_the_same_rule(holder):
    recycler = BufferPool()
    buffer = recycler.empty("b", N, torch.float32, CPU)
    buffer.copy_(torch.arange(float(N)))
    kept, pointer = HOLDERS[holder](buffer), buffer.data_ptr()
    del buffer
    fresh = recycler.empty("b", N, torch.float32, CPU)
    assert fresh.data_ptr() != pointer
    del kept
    pointers = {pointer, fresh.data_ptr()}
    del fresh
    assert recycler.empty("b", N, torch.float32, CPU).data_ptr() in pointers


@pytest.mark.parametrize("with_memset", [True, False], ids=["C memset", "torch zero_"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_a_reused_buffer_is_all_zero_bits_whichever_way_it_is_cleared(monkeypatch, with_memset, dtype):
    if not with_memset:
        monkeypatch.setattr(recycle, "_c_memset", lambda: None)
    else:
        assert recycle._c_memset() is not None  # this machine's C library has one
    recycler = BufferPool()
    first = recycler.zeros("bucket", 1000, dtype, torch.device("cpu"))
    first.fill_(-1)  # every bit pattern set where it matters: -0.0 would not be +0
    first[::2] = -0.0 if dtype.is_floating_point else -1
    pointer = first.data_ptr()
    del first
    again = recycler.zeros("bucket", 1000, dtype, torch.device("cpu"))
    assert again.data_ptr() == pointer  # the same buffer, cleared
    assert torch.equal(again.view(torch.uint8), torch.zeros(1000 * again.element_size(), dtype=torch.uint8))


def test_another_size_or_dtype_gets_a_new_buffer():
    recycler = BufferPool()
    recycler.zeros("b", N, torch.float32, CPU)
    assert recycler.zeros("b", N + 1, torch.float32, CPU).shape == (N + 1,)
    assert recycler.zeros("b", N + 1, torch.float64, CPU).dtype == torch.float64


def test_buffers_below_the_minimum_are_always_new():
    recycler = BufferPool(min_bytes=4 * N)
    first = recycler.zeros("b", N - 1, torch.float32, CPU)
    first.fill_(1.0)
    pointer = first.data_ptr()
    del first
    assert torch.equal(recycler.zeros("b", N - 1, torch.float32, CPU), torch.zeros(N - 1))
    second = recycler.zeros("b", N, torch.float32, CPU)  # at the minimum: kept
    pointer = second.data_ptr()
    del second
    assert recycler.zeros("b", N, torch.float32, CPU).data_ptr() == pointer


SHAPES = {"w1": (300, 200), "b1": (300,), "w2": (100, 300)}


def steps(backend, keep_results: bool, count: int = 4):
    """Top-k + EF over one fused bucket; returns every step's results (clones, and the tensors
    themselves when kept) and where each step's results lived."""
    bundle = Grace(TopK(0.01), memory=Residual(), bucket_bytes=1 << 20)
    bundle.plan_buckets([(n, 4 * torch.Size(s).numel()) for n, s in SHAPES.items()])
    clones, kept, pointers = [], [], []
    for step in range(count):
        generator = torch.Generator().manual_seed(100 * step + backend.rank())
        pending = {n: bundle.start(torch.randn(s, generator=generator), n, backend, True) for n, s in SHAPES.items()}
        results = {n: p() for n, p in pending.items()}
        bundle.end_step()
        clones.append({n: r.clone() for n, r in results.items()})
        pointers.append(results["w1"].data_ptr())
        if keep_results:
            kept.append(results)
        del results, pending
    return clones, kept, pointers


def test_results_kept_by_the_caller_stay_as_they_were_and_dropped_ones_make_room():
    held = run_ranks(2, lambda backend: steps(backend, keep_results=True))
    dropped = run_ranks(2, lambda backend: steps(backend, keep_results=False))
    for rank in range(2):
        clones, kept, pointers = held[rank]
        for step, results in enumerate(kept):  # never overwritten by a later step
            for name, result in results.items():
                assert torch.equal(result, clones[step][name]), (rank, step, name)
        assert len(set(pointers)) == len(pointers)
        dropped_clones, _, dropped_pointers = dropped[rank]
        assert len(set(dropped_pointers[1:])) == 1  # one buffer, used again every step once let go
        for step in range(len(clones)):  # and the same results either way, bit for bit
            for name in SHAPES:
                assert torch.equal(dropped_clones[step][name], clones[step][name]), (rank, step, name)


def test_a_decompressed_tensor_the_caller_keeps_is_not_overwritten_by_the_next(monkeypatch):
    monkeypatch.setattr(entries, "LARGE", 0)  # keep outputs of any size, as for large tensors
    compressor = TopK(0.1)
    generator = torch.Generator().manual_seed(3)
    tensors = [torch.randn(50, 40, generator=generator) for _ in range(3)]
    kept = []
    for tensor in tensors:
        payload, ctx = compressor.compress(tensor, "w")
        kept.append(compressor.decompress(payload, ctx))
    for tensor, decoded in zip(tensors, kept, strict=True):  # each still the sparse part of its own tensor
        assert torch.equal(decoded, torch.where(decoded != 0, tensor, torch.zeros(())))
        assert int((decoded != 0).sum()) == 200
    assert len({decoded.data_ptr() for decoded in kept}) == 3
    del kept, decoded
    pointers = set()
    for tensor in tensors:  # let go at once: one buffer serves them all
        payload, ctx = compressor.compress(tensor, "w")
        pointers.add(compressor.decompress(payload, ctx).data_ptr())
    assert len(pointers) == 1
