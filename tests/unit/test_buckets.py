"""Fused buckets (``communicators/fusion.py``): they give exactly what per-tensor collectives give,
with fewer collectives, for every kind of payload (a bucket of scattered members as each member
alone), however the gradients arrive; a tensor larger than a bucket; waiting before a bucket is
complete is an error, not a hang; the plan's checks and its default size (Horovod's fusion
threshold, up to 16 MiB); and non-finite tensors named alike with and without buckets."""

import pytest
import torch

from grace_legacy import (
    DGC,
    FP16,
    Allgather,
    Grace,
    Legacy,
    NoMemory,
    PowerSGD,
    PowerSGDMemory,
    RandomK,
    Residual,
    Threshold,
    TopK,
)
from grace_legacy.communicators.fusion import BUCKET_BYTES_CAP, BucketPlan, default_bucket_bytes
from tests.helpers import run_ranks

SHAPES = {"conv": (8, 4, 3), "fc1": (60, 40), "bias1": (60,), "fc2": (10, 60), "bias2": (10,), "scale": ()}
# Dense bytes in reverse registration order, as the Horovod integration plans them.
SIZES = [(name, 4 * torch.Size(shape).numel()) for name, shape in reversed(SHAPES.items())]

COMPRESSORS = {
    "topk": lambda: Grace(TopK(0.05), memory=Residual(), communicator=Allgather()),
    "threshold": lambda: Grace(Threshold(1.0), memory=Residual()),
    "randomk": lambda: Grace(RandomK(0.1, seed=4), memory=Residual()),
    "fp16": lambda: Grace(FP16()),
    "powersgd": lambda: Grace(PowerSGD(2, seed=1), memory=PowerSGDMemory()),
    "legacy": lambda: Grace(Legacy(TopK(), by="layer", values=[1.0, 0.2, 0.02], splits=[100, 1000]),
                            memory=Residual(), communicator=Allgather()),
}


def gradient(rank: int, step: int, name: str) -> torch.Tensor:
    seed = 1000 * step + 17 * rank + sorted(SHAPES).index(name)
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed))


def train(backend, make_bundle, bucket_bytes, steps=3, shuffle=False):
    bundle = make_bundle()
    bundle.bucket_bytes = bucket_bytes
    bundle.plan_buckets(SIZES)
    out = []
    for step in range(steps):
        names = list(SHAPES)
        if shuffle:  # gradients arrive in a different order on every rank
            g = torch.Generator().manual_seed(step * 10 + backend.rank())
            names = [names[i] for i in torch.randperm(len(names), generator=g).tolist()]
        pending = {n: bundle.start(gradient(backend.rank(), step, n), n, backend, True) for n in names}
        out.append({n: pending[n]() for n in SHAPES})
        bundle.end_step()
    return out, bundle.stats, list(backend.calls)


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_buckets_give_exactly_what_single_tensors_give(kind):
    alone = run_ranks(4, lambda b: train(b, COMPRESSORS[kind], bucket_bytes=0))
    fused = run_ranks(4, lambda b: train(b, COMPRESSORS[kind], bucket_bytes=1 << 20, shuffle=True))
    for rank in range(4):
        (want, want_stats, want_calls), (got, stats, calls) = alone[rank], fused[rank]
        for step in range(3):
            for name in SHAPES:
                assert torch.equal(got[step][name], want[step][name]), (kind, rank, step, name)
        assert stats == want_stats
        assert sum(n for _, n in calls) == sum(n for _, n in want_calls) == stats["bytes_sent"]
        # One bucket: at most one collective per kind (and dtype) per round, not one per tensor.
        rounds = 2 if kind == "powersgd" else 1
        assert len(calls) <= 3 * 2 * rounds < len(want_calls), (len(calls), len(want_calls))


def test_several_buckets_and_a_tensor_larger_than_a_bucket():
    plan = BucketPlan(SIZES, bucket_bytes=500)
    assert plan.buckets == [["scale", "bias2"], ["fc2"], ["bias1"], ["fc1"], ["conv"]]
    assert BucketPlan(SIZES, bucket_bytes=1 << 30).buckets == [[n for n, _ in SIZES]]
    fused = run_ranks(2, lambda b: train(b, COMPRESSORS["legacy"], bucket_bytes=500))
    alone = run_ranks(2, lambda b: train(b, COMPRESSORS["legacy"], bucket_bytes=0))
    for rank in range(2):
        for step in range(3):
            for name in SHAPES:
                assert torch.equal(fused[rank][0][step][name], alone[rank][0][step][name])


def test_waiting_before_the_bucket_is_complete_is_an_error_not_a_hang():
    def body(backend):
        bundle = Grace(TopK(0.1), bucket_bytes=1 << 20)
        bundle.plan_buckets(SIZES)
        early = bundle.start(gradient(backend.rank(), 0, "fc1"), "fc1", backend, True)
        with pytest.raises(RuntimeError, match="before its bucket was complete"):
            early()
        return True

    assert run_ranks(2, body) == [True, True]


def test_bucket_plan_validation():
    with pytest.raises(ValueError, match="unique"):
        BucketPlan([("a", 4), ("a", 4)], 100)
    with pytest.raises(ValueError, match="bucket_bytes"):
        Grace(TopK(0.1), bucket_bytes=-1)


MIB = 1 << 20


@pytest.mark.parametrize("setting,expected", [(None, 16 * MIB), ("0", 0), ("1048576", MIB),
                                              (str(16 * MIB), 16 * MIB), (str(128 * MIB), 16 * MIB)])
def test_default_buckets_follow_horovods_threshold_up_to_16_mib(monkeypatch, setting, expected):
    if setting is None:
        monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    else:
        monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", setting)
    assert BUCKET_BYTES_CAP == 16 * MIB
    assert default_bucket_bytes() == expected
    assert Grace(TopK(0.1)).bucket_bytes == expected
    assert Grace(TopK(0.1), bucket_bytes=64 * MIB).bucket_bytes == 64 * MIB  # an explicit size is kept


@pytest.mark.parametrize("setting", ["-1", "64MB", "", "1.5"])
def test_an_unreadable_fusion_threshold_is_named(monkeypatch, setting):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", setting)
    message = f"HOROVOD_FUSION_THRESHOLD must be a whole number of bytes >= 0, got {setting!r}"
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        Grace(TopK(0.1))
    assert Grace(TopK(0.1), bucket_bytes=0).bucket_bytes == 0  # not read when a size is given


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20])
@pytest.mark.parametrize("kind", ["topk", "threshold"])
def test_exactly_the_tensors_whose_gradient_or_sum_is_not_finite_are_named(kind, bucket_bytes):
    """fc1's entries are finite on every rank but their sum overflows; bias1 holds a NaN on rank 1
    only; the other tensors stay finite. Buckets name the same tensors as per-tensor sends. Top-k
    sends every NaN and infinity it is given, so each rank sees them in its results and no flags
    are exchanged; Threshold may drop a NaN, so its ranks exchange flags."""
    def body(backend):
        compressor = TopK(0.1) if kind == "topk" else Threshold(2.0)
        bundle = Grace(compressor, memory=Residual(), bucket_bytes=bucket_bytes)
        bundle.plan_buckets(SIZES)
        named = []
        for step in range(2):
            pending = {}
            for name in SHAPES:
                grad = gradient(backend.rank(), step, name)
                if step == 0 and name == "fc1":
                    grad[0, 0] = 3e38
                if step == 0 and name == "bias1" and backend.rank() == 1:
                    grad[5] = float("nan")
                pending[name] = bundle.start(grad, name, backend, True)
            results = {name: p() for name, p in pending.items()}
            before = len(backend.calls)
            flagged = bundle.guard.nonfinite_names(list(SHAPES), backend)
            assert len(backend.calls) - before == (0 if kind == "topk" else 1)
            if kind == "topk":  # seen in the results themselves
                assert flagged == {name for name, r in results.items() if not bool(torch.isfinite(r).all())}
            named.append(flagged)
            for name in flagged:
                bundle.guard.undo(name)
            bundle.end_step()
        return named

    assert run_ranks(2, body) == [[{"fc1", "bias1"}, set()]] * 2


@pytest.mark.parametrize("make", [lambda: TopK(0.2), lambda: DGC(0.2, min_samples=4),
                                  lambda: Legacy(TopK(), by="layer", values=[0.5, 0.1], splits=[50])])
def test_a_bucket_of_scattered_members_aggregates_as_each_member_alone(make):
    """The bucket's joint scatter-add against each member's own ``aggregate`` (4 threaded ranks)."""
    shapes = {"a": (30,), "b": (8, 9), "c": (200,), "d": ()}

    def run(backend, bucket_bytes):
        bundle = Grace(make(), memory=NoMemory(), dense_fallback=False, communicator=Allgather())
        bundle.bucket_bytes = bucket_bytes
        bundle.plan_buckets([(n, 4 * torch.Size(s).numel()) for n, s in shapes.items()])
        grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(7 * backend.rank() + i))
                 for i, (n, s) in enumerate(shapes.items())}
        pending = {n: bundle.start(g, n, backend, True) for n, g in grads.items()}
        return {n: p() for n, p in pending.items()}

    alone, fused = run_ranks(4, lambda b: run(b, 0)), run_ranks(4, lambda b: run(b, 1 << 20))
    for rank in range(4):
        for name in shapes:
            assert torch.equal(fused[rank][name], alone[rank][name]), (rank, name)
