"""One flight of many tensors' payloads (``communicators/exchange.py``): a bucket of Top-k payloads
goes by part (every member's values, then every member's indices) only where that sends exactly
the members' bytes, and aggregates exactly either way; a bucket of one compressor's one-part payloads
is decoded at once; later rounds advance in lockstep across flights."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import Allgather, Allreduce, TopK
from grace_legacy.communicators.exchange import BucketExchange
from grace_legacy.core.communicator import Parcel
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
        members = [Parcel(n, payload, ctx, compressor, Allgather())
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


def _fp16_sum(values: list[torch.Tensor], world: int) -> torch.Tensor:
    """What an fp16 allreduce averages to, written apart: fp16 casts added in rank order in fp16,
    divided by the ranks in fp16, cast back to fp32."""
    total = values[0].half().clone()
    for value in values[1:]:
        total += value.half()
    return (total / world).float()


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("overflow", [False, True])
def test_a_bucket_of_fp16_payloads_is_decoded_at_once_bit_for_bit_and_looked_at_whole(overflow, into):
    """FP16 parcels of one flight are decoded by one cast of the reduced flat (each result a piece
    of it; of ``into`` when given, as DDP's bucket is), equal to the fp16 average of every rank's
    casts; a flat whose sum is finite marks every parcel finite, one holding an inf (70000
    overflows fp16) marks none, so each is looked at alone."""
    from grace_legacy import FP16

    shapes = {"a": (31,), "b": (7, 9), "c": (201,)}
    compressor = FP16()
    world = 3

    def gradients(rank):
        grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(10 * rank + i))
                 for i, (n, s) in enumerate(shapes.items())}
        if overflow and rank == 1:
            grads["b"][2, 3] = 70000.0
        return grads

    def body(backend):
        members = [Parcel(n, *compressor.compress(g, n), compressor, Allreduce())
                   for n, g in gradients(backend.rank()).items()]
        bucket = torch.full((sum(torch.Size(s).numel() for s in shapes.values()),), float("nan")) if into else None
        BucketExchange("bucket", members, backend, average=True, into=bucket)
        results = {m.name: m.pending() for m in members}
        return results, {m.name: m.pending.finite for m in members}, list(backend.calls), bucket

    for results, finite, calls, bucket in run_ranks(world, body):
        assert [kind for kind, _ in calls] == ["allreduce"]  # one fp16 flat
        base = results["a"].untyped_storage().data_ptr()
        assert all(r.untyped_storage().data_ptr() == base for r in results.values())  # pieces of one cast
        if into:
            assert base == bucket.data_ptr()
            assert torch.equal(bucket, torch.cat([results[name].reshape(-1) for name in shapes]))
        for name in shapes:
            want = _fp16_sum([gradients(rank)[name] for rank in range(world)], world)
            assert torch.equal(results[name], want), name
        assert finite == dict.fromkeys(shapes, not overflow)


def test_later_rounds_advanced_in_lockstep_issue_in_one_order_and_give_the_same_bits():
    """Two PowerSGD flights advanced round by round (the DDP hook's lockstep) issue round 0 of both,
    then round 1 of both, and deliver the bits of flights finished one after the other."""
    from grace_legacy import PowerSGD

    shapes = {"first": [(16, 12), (8, 20)], "second": [(10, 10), (6, 30)]}
    world = 2

    def run(lockstep):
        def body(backend):
            compressor = PowerSGD(2)
            compressor.set_rank(backend.rank())
            flights = []
            for label, members in shapes.items():
                parcels = []
                for i, shape in enumerate(members):
                    grad = torch.randn(shape, generator=torch.Generator().manual_seed(100 * backend.rank() + i))
                    parcels.append(Parcel(f"{label}{i}", *compressor.compress(grad, f"{label}{i}"), compressor,
                                          Allreduce()))
                flights.append((BucketExchange(label, parcels, backend, average=True), parcels))
            if lockstep:
                advancing = [flight for flight, _ in flights]
                while advancing:
                    advancing = [flight for flight in advancing if flight.advance()]
            results = {p.name: p.pending() for _, parcels in flights for p in parcels}
            return results, [(kind, size) for kind, size in backend.calls]
        return run_ranks(world, body)

    one_by_one, lockstep = run(False), run(True)
    for (want, _), (got, calls) in zip(one_by_one, lockstep, strict=True):
        assert want.keys() == got.keys()
        assert all(torch.equal(want[n], got[n]) for n in want)
        # P of both flights, then Q of both: (16 + 8) * 2 and (10 + 6) * 2 fp32 values, then (12 + 20) * 2 and
        # (10 + 30) * 2.
        assert calls == [("allreduce", 4 * 48), ("allreduce", 4 * 32), ("allreduce", 4 * 64), ("allreduce", 4 * 80)]


@pytest.mark.parametrize("poison", [None, "dense nan", "matrix inf", "fp16 overflow"])
def test_a_multi_round_flight_vouches_for_finite_results_without_looking_at_them(poison):
    """PowerSGD's results are marked finite from a bound on their factors (``surely_finite``), and
    the tensors sent as they are beside them from their first flat's finite sum: nobody looks at
    either again. An inf or NaN on one rank, or an fp16 result that overflows in its cast, leaves
    the parcels it reaches unmarked (so the step guard looks at them), and a marked result is
    finite."""
    from grace_legacy import NoCompression, PowerSGD

    dtype = torch.float16 if poison == "fp16 overflow" else torch.float32
    shapes = {"w1": (12, 9), "b1": (12,), "w2": (6, 20), "b2": (6,)}
    world = 2

    def gradients(rank):
        grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(10 * rank + i)).to(dtype)
                 for i, (n, s) in enumerate(shapes.items())}
        if rank == 1 and poison == "dense nan":
            grads["b1"][3] = float("nan")
        if rank == 1 and poison == "matrix inf":
            grads["w2"][2, 5] = float("inf")
        if poison == "fp16 overflow":
            grads["w1"].fill_(60000.0)  # a rank-1 matrix whose average decodes near fp16's largest value
        return grads

    def body(backend):
        compressor = PowerSGD(2)
        members = []
        for name, grad in gradients(backend.rank()).items():
            chosen = compressor.compressor_for(grad, name) or NoCompression()
            members.append(Parcel(name, *chosen.compress(grad, name), chosen, Allreduce()))
        BucketExchange("bucket", members, backend, average=True)
        return {m.name: m.pending() for m in members}, {m.name: m.pending.finite for m in members}

    for results, finite in run_ranks(world, body):
        for name, result in results.items():
            if finite[name]:
                assert bool(torch.isfinite(result).all()), name
        if poison is None:
            assert all(finite.values()), finite
        elif poison == "dense nan":  # its flat's sum is NaN: neither dense tensor is vouched for
            assert not finite["b1"] and not finite["b2"] and finite["w1"] and finite["w2"]
        elif poison == "matrix inf":  # the inf reaches w2's factors and the first flat's sum
            assert not finite["w2"] and not finite["b1"] and not finite["b2"] and finite["w1"]
        else:
            assert not finite["w1"] and finite["w2"] and finite["b1"] and finite["b2"]
