"""One flight of many tensors' payloads (``communicators/exchange.py``): a bucket of Top-k payloads
goes by part (every member's values, then every member's indices) only where that sends exactly
the members' bytes, and aggregates exactly either way."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import TopK
from grace_legacy.communicators.exchange import BucketExchange, Parcel
from grace_legacy.runtime import wire
from tests.helpers import run_ranks


@pytest.mark.parametrize("dtype, by_part", [(torch.float32, True), (torch.float64, False), (torch.float16, False),
                                            (torch.bfloat16, False)])
def test_a_bucket_goes_by_part_only_when_that_sends_the_same_bytes_and_aggregates_exactly_either_way(
        dtype, by_part, monkeypatch):
    """Top-k at 0.05 keeps 1, 3 and 10 entries: fp32 values and int32 indices pack by part into
    exactly the members' bytes; wider or narrower values would change the padding, so those
    buckets keep each payload's own packing. Each result is checked against the compressor's own
    ``aggregate`` of every rank's payload."""
    shapes = {"a": (31,), "b": (7, 9), "c": (201,)}
    compressor = TopK(0.05)
    world = 3

    def payloads(rank):
        grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(10 * rank + i)).to(dtype)
                 for i, (n, s) in enumerate(shapes.items())}
        return {n: compressor.compress(g, n) for n, g in grads.items()}

    packings = []

    def spy(packing):
        original = getattr(wire, packing)

        def packed(*args):
            packings.append(packing)
            return original(*args)
        return packed

    for packing in ("pack_columns", "pack_many"):
        monkeypatch.setattr(wire, packing, spy(packing))

    def body(backend):
        members = [Parcel(n, payload, ctx, compressor, gathered=True)
                   for n, (payload, ctx) in payloads(backend.rank()).items()]
        BucketExchange("bucket", members, backend, average=True)
        return {m.name: m.pending() for m in members}, sum(m.pending.bytes_sent for m in members), list(backend.calls)

    ranks = run_ranks(world, body)
    assert set(packings) == {"pack_columns" if by_part else "pack_many"}
    sent = [payloads(rank) for rank in range(world)]
    for results, bytes_sent, calls in ranks:
        assert calls == [("allgather", bytes_sent)]
        for name in shapes:
            want = compressor.aggregate([sent[rank][name][0] for rank in range(world)], sent[0][name][1], True)
            assert torch.equal(results[name], want), name
