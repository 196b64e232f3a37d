"""A communicator written outside the library (``tests/example_communicator.py``) runs per tensor
and in fused buckets through the same ``Communicator`` interface as the library's own: one
allreduce a bucket when it fuses (``start_many``), one a tensor when it only implements ``start``,
the same bits either way, and error feedback learns from what it sent."""

import pytest
import torch

from grace_legacy import FP16, Communicator, Grace, NoMemory, RandomK, Residual
from tests.example_communicator import Float64Sum
from tests.helpers import run_ranks

SHAPES = {"a": (40, 3), "b": (17,), "c": (5, 5)}
SIZES = [(name, 4 * torch.Size(shape).numel()) for name, shape in SHAPES.items()]


class StartOnly(Float64Sum):
    """The same sums with only ``start``: the default ``start_many`` sends tensor by tensor."""

    start_many = Communicator.start_many

    def start(self, parcel, backend, average):
        Float64Sum.start_many(self, parcel.name, [parcel], backend, average)
        return parcel.pending


def gradient(rank: int, step: int, name: str) -> torch.Tensor:
    seed = 100 * step + 10 * rank + sorted(SHAPES).index(name)
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed))


def train(backend, make, communicator, bucket_bytes):
    bundle = Grace(make(), memory=NoMemory(), communicator=communicator, bucket_bytes=bucket_bytes)
    bundle.plan_buckets(SIZES)
    out = []
    for step in range(2):
        pending = {n: bundle.start(gradient(backend.rank(), step, n), n, backend, True) for n in SHAPES}
        out.append({n: p() for n, p in pending.items()})
        bundle.end_step()
    return out, [kind for kind, _ in backend.calls], bundle


@pytest.mark.parametrize("make", [FP16, lambda: RandomK(0.3, seed=2)], ids=["fp16", "randomk"])
def test_a_user_communicator_fuses_through_start_many(make):
    world = 3
    fused = run_ranks(world, lambda b: train(b, make, Float64Sum(), 1 << 20))
    alone = run_ranks(world, lambda b: train(b, make, Float64Sum(), 0))
    start_only = run_ranks(world, lambda b: train(b, make, StartOnly(), 1 << 20))
    assert [len(calls) for _, calls, _ in fused] == [2] * world  # one allreduce a step: the bucket
    assert [len(calls) for _, calls, _ in alone] == [2 * len(SHAPES)] * world
    assert [len(calls) for _, calls, _ in start_only] == [2 * len(SHAPES)] * world
    for (got, _, _), (want, _, _), (also, _, _) in zip(fused, alone, start_only, strict=True):
        for step in range(2):
            for name in SHAPES:
                assert torch.equal(got[step][name], want[step][name])
                assert torch.equal(also[step][name], want[step][name])
    # The reference: each rank's payload decoded, summed in float64, averaged, rounded once.
    compressors = [make() for _ in range(world)]  # each rank's, counting its own steps
    for rank, compressor in enumerate(compressors):
        compressor.set_rank(rank)
    for step in range(2):
        for name in SHAPES:
            payloads = [compressor.compress(gradient(rank, step, name), name)
                        for rank, compressor in enumerate(compressors)]
            compressor = compressors[0]
            parts = [sum(p[0][i].double() for p in payloads) / world for i in range(len(payloads[0][0]))]
            expected = compressor.decompress([part.to(payloads[0][0][i].dtype) for i, part in enumerate(parts)],
                                             payloads[0][1])
            assert torch.equal(fused[0][0][step][name], expected), (step, name)


def test_error_feedback_learns_from_what_a_user_communicator_sent():
    def body(backend):
        bundle = Grace(RandomK(0.3, seed=2), memory=Residual(), communicator=Float64Sum(), bucket_bytes=1 << 20)
        bundle.plan_buckets(SIZES)
        grads = {n: gradient(backend.rank(), 0, n) for n in SHAPES}
        pending = {n: bundle.start(g.clone(), n, backend, True) for n, g in grads.items()}
        for p in pending.values():
            p()
        sent = {}
        twin = RandomK(0.3, seed=2)
        twin.set_rank(backend.rank())
        for n, g in grads.items():
            payload, ctx = twin.compress(g, n)
            sent[n] = g - twin.decompress(payload, ctx)
        return {n: bundle.memory.state_dict()["residuals"][n] for n in SHAPES}, sent

    for residuals, expected in run_ranks(2, body):
        for name in SHAPES:
            assert torch.equal(residuals[name], expected[name])
