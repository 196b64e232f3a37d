"""Fused buckets: many tensors' payloads exchanged by one flight (:mod:`~grace_legacy.communicators.exchange`)
instead of one each. Membership is fixed from the parameter order, so every rank packs the same
parcels in the same order; a bucket takes off as soon as its last parcel is started
(docs/DESIGN.md#fused-buckets)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from grace_legacy.communicators.exchange import BucketExchange, Parcel
from grace_legacy.communicators.scatter_gather import ShardedExchange
from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.memory import Memory
from grace_legacy.runtime.buffers import BufferPool

#: Horovod's own default fusion threshold, used when the environment sets none.
_HOROVOD_FUSION_DEFAULT = 64 * 1024 * 1024

#: The largest default bucket, below glibc's 32 MiB mmap ceiling (docs/DESIGN.md#bucket-cap).
BUCKET_BYTES_CAP = 16 * 1024 * 1024


def default_bucket_bytes() -> int:
    """The smaller of ``HOROVOD_FUSION_THRESHOLD`` (read as Horovod reads it; its 64 MiB when
    unset, ``0`` for no fusion) and :data:`BUCKET_BYTES_CAP`."""
    setting = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if setting is None:
        return min(_HOROVOD_FUSION_DEFAULT, BUCKET_BYTES_CAP)
    try:
        threshold = int(setting)
    except ValueError:
        threshold = -1
    if threshold < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD must be a whole number of bytes >= 0, got {setting!r}")
    return min(threshold, BUCKET_BYTES_CAP)


class BucketPlan:
    """Which tensors fly together: consecutive tensors, in the given order (best: the order their
    gradients are expected), filled up to ``bucket_bytes`` of *dense* size; a larger one flies alone."""

    def __init__(self, sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> None:
        if bucket_bytes < 0:
            raise ValueError(f"BucketPlan: bucket_bytes must be >= 0, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.buckets: list[list[str]] = []
        filled = bucket_bytes  # forces a new bucket for the first tensor
        for name, size in sizes:
            if not self.buckets or filled + size > bucket_bytes:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(name)
            filled += size
        self.bucket_of = {name: index for index, names in enumerate(self.buckets) for name in names}
        if len(self.bucket_of) != sum(len(b) for b in self.buckets):
            raise ValueError("BucketPlan: tensor names must be unique")

    def __repr__(self) -> str:
        return f"BucketPlan({len(self.buckets)} buckets of up to {self.bucket_bytes} bytes)"


def launch_bucket(label: str, parcels: list[Parcel], backend: Backend, average: bool, pool: BufferPool,
                  owner_memory: Memory | None, into: torch.Tensor | None = None) -> BucketExchange | None:
    """Launch one bucket's parcels: those that go to the shards' owners in one scatter-gather,
    the rest in one exchange (one gather, one allreduce per dtype), which is returned; ``into``:
    the exchange's (:class:`BucketExchange`)."""
    rest = [p for p in parcels if not p.sharded]
    exchange = BucketExchange(label, rest, backend, average, pool, into if len(rest) == len(parcels) else None) \
        if rest else None
    sharded = [p for p in parcels if p.sharded]
    if sharded:
        ShardedExchange(label, sharded, backend, average, owner_memory)
    return exchange


class BucketFiller:
    """Collects each bucket's parcels during a step and launches the bucket once it is full."""

    def __init__(self, plan: BucketPlan, owner_memory: Memory | None = None) -> None:
        self.plan = plan
        #: the error feedback a scatter-gather's owners apply (:class:`ShardedExchange`)
        self.owner_memory = owner_memory
        self._open: dict[int, dict[str, Parcel]] = {}
        # Each bucket's aggregate buffer, used again by its next flight once the caller has let go.
        self._recycler = BufferPool()

    def add(self, parcel: Parcel, backend: Backend, average: bool) -> Pending:
        index = self.plan.bucket_of[parcel.name]
        entries = self._open.setdefault(index, {})
        if parcel.name in entries:
            raise RuntimeError(f"the gradient of {parcel.name!r} was sent twice in one step")
        entries[parcel.name] = parcel
        names = self.plan.buckets[index]
        if len(entries) == len(names):
            del self._open[index]
            launch_bucket(f"bucket{index}", [entries[n] for n in names], backend, average, self._recycler,
                          self.owner_memory)
        return parcel.pending

    def unlaunched(self) -> set[str]:
        """The parcels of buckets that have not taken off yet."""
        return {name for entries in self._open.values() for name in entries}

    def abandon(self) -> None:
        """Drop the parcels of buckets that have not taken off: the step was abandoned."""
        self._open.clear()

    def waiting(self) -> dict[int, list[str]]:
        """Buckets started but not complete, with the parcels still missing."""
        return {index: [n for n in self.plan.buckets[index] if n not in entries]
                for index, entries in self._open.items()}
