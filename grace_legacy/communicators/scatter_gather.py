"""ScatterGather: a two-phase compressed allreduce, whose link bytes per rank stay about
``2 (P - 1) / P`` times the payload at any number of ranks ``P``.

The tensors of a bucket, flattened back to back, are cut into ``P`` contiguous shards, shard ``j``
owned by rank ``j``; a tensor that straddles a boundary is cut into segments. Then:

1. every rank compresses each segment as a tensor of its own and sends shard ``j``'s segments to
   rank ``j`` (one all-to-all);
2. rank ``j`` aggregates every rank's payload of each of its segments with the compressor's own
   rule (a mean; Signum's and signSGD's majority vote), compresses the aggregate again
   (:meth:`~grace_legacy.core.compressor.Compressor.for_sums`; for a compressor paired with error
   feedback, with an error-feedback memory of the owner's own, as DeepSpeed's compressed allreduce
   keeps a "server" error), and every rank gathers the owners' payloads (one allgather) and
   decodes them.

Every rank ends with the same bits: each decodes the same owner payloads. A rank's link carries
its segments for the other owners, then the other owners' payloads, so the ratio to a dense ring
allreduce is the compressor's own whatever ``P`` (runtime/cost.py). The price: a second lossy
step at the owner, and a second collective in sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from grace_legacy.core.backend import Backend, Pending, computed_once
from grace_legacy.core.communicator import Communicator, Flight, Parcel
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.runtime import wire
from grace_legacy.runtime.validation import check_flag


def shard_bounds(total: int, world_size: int) -> list[int]:
    """The ``P + 1`` offsets cutting ``total`` elements into ``P`` contiguous shards whose sizes
    differ by at most one, the larger first."""
    base, extra = divmod(total, world_size)
    bounds = [0]
    for j in range(world_size):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return bounds


class Segment(NamedTuple):
    """Elements ``[start, stop)`` of a parcel's flattened tensor, owned by rank ``owner``."""

    parcel: int
    start: int
    stop: int
    owner: int


def segments_of(sizes: Sequence[int], world_size: int) -> list[Segment]:
    """The segments of tensors of ``sizes`` elements laid back to back and cut into shards, in
    bucket order (so each owner's segments are contiguous in the list)."""
    bounds = shard_bounds(sum(sizes), world_size)
    out, offset, owner = [], 0, 0
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            while bounds[owner + 1] <= offset + start:
                owner += 1
            stop = min(size, bounds[owner + 1] - offset)
            out.append(Segment(index, start, stop, owner))
            start = stop
        offset += size
    return out


def segment_name(name: str, start: int, stop: int) -> str:
    """The name a segment is compressed under (its randomness, its owner's memory)."""
    return f"{name}[{start}:{stop}]"


@dataclass
class _Pieces:
    """A tensor compressed segment by segment: each segment's range, payload length and context."""

    shape: torch.Size
    dtype: torch.dtype
    ranges: list[tuple[int, int]]
    lengths: list[int]
    contexts: list[Any]


class Segmented:
    """Decodes the payload of a tensor compressed segment by segment (what its error feedback
    learns from): the segments' payloads back to back, decoded by the compressor that encoded them."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.traits = compressor.traits

    def _split(self, payload: Payload, pieces: _Pieces) -> list[Payload]:
        out, at = [], 0
        for length in pieces.lengths:
            out.append(payload[at: at + length])
            at += length
        return out

    def decompress(self, payload: Payload, pieces: _Pieces) -> torch.Tensor:
        parts = [self.compressor.decompress(p, ctx).reshape(-1)
                 for p, ctx in zip(self._split(payload, pieces), pieces.contexts, strict=True)]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.view(pieces.shape)

    def support(self, payload: Payload, pieces: _Pieces) -> torch.Tensor:
        return torch.cat([self.compressor.support(p, ctx).to(torch.int64) + start
                          for p, ctx, (start, _) in zip(self._split(payload, pieces), pieces.contexts,
                                                        pieces.ranges, strict=True)])


class ShardedExchange:
    """The two phases of one set of parcels (a bucket's, or one tensor's), launched at
    construction (the all-to-all) and finished once (the owners' allgather). The owners apply the
    parcels' ``owner_memory`` (keyed by segment; one per bundle) before re-compressing their sums."""

    def __init__(self, label: str, parcels: Sequence[Parcel], backend: Backend, average: bool,
                 owner_feedback: bool = True) -> None:
        self.label, self.parcels, self.backend, self.average = label, list(parcels), backend, average
        self.owner_memory = self.parcels[0].owner_memory if owner_feedback else None
        self.size, self.rank = backend.size(), backend.rank()
        self._failure: BaseException | None = None
        self.results: dict[str, torch.Tensor] | None = None
        for parcel in self.parcels:
            if parcel.compressor.traits.rounds != 1:
                raise ValueError(f"ScatterGather cannot run {parcel.compressor!r}: it needs "
                                 f"{parcel.compressor.traits.rounds} allreduce rounds")
        tensors = [parcel.payload[0] for parcel in self.parcels]
        self._like = [(t.shape, t.dtype, t.device) for t in tensors]
        self.segments = segments_of([t.numel() for t in tensors], self.size)
        # Each parcel's and each owner's segments, as indices into self.segments (one pass: a
        # bucket has about P segments, and a scan per owner would cost P^2 at every rank).
        self._of_parcel: list[list[int]] = [[] for _ in self.parcels]
        self._of_owner: list[list[int]] = [[] for _ in range(self.size)]
        for i, segment in enumerate(self.segments):
            self._of_parcel[segment.parcel].append(i)
            self._of_owner[segment.owner].append(i)
        # Phase 1: every segment compressed as a tensor of its own.
        self.payloads: list[Payload] = []
        self.contexts: list[Any] = []
        for segment in self.segments:
            parcel = self.parcels[segment.parcel]
            piece = tensors[segment.parcel].reshape(-1)[segment.start: segment.stop]
            payload, ctx = parcel.compressor.compress(piece, segment_name(parcel.name, segment.start, segment.stop))
            self.payloads.append(payload)
            self.contexts.append(ctx)
        for index, parcel in enumerate(self.parcels):
            mine = self._of_parcel[index]
            pieces = _Pieces(tensors[index].shape, tensors[index].dtype,
                             [(self.segments[i].start, self.segments[i].stop) for i in mine],
                             [len(self.payloads[i]) for i in mine], [self.contexts[i] for i in mine])
            parcel.payload = [part for i in mine for part in self.payloads[i]]
            parcel.ctx = pieces
            parcel.feed_back(parcel.payload, parcel.ctx, Segmented(parcel.compressor))
        self.headers = [not self.parcels[s.parcel].compressor.traits.uniform_payload for s in self.segments]
        # The owners' payloads have the layout of this rank's own payload of the same segment,
        # unless the owners encode with another compressor (a vote's code) or the size varies.
        compressors = [self.parcels[s.parcel].compressor for s in self.segments]
        self.sum_headers = [header or c.for_sums() is not c
                            for header, c in zip(self.headers, compressors, strict=True)]
        try:
            self._launch()
        except BaseException as error:
            for parcel in self.parcels:
                parcel.pending.fail_with(error)
            raise
        for parcel in self.parcels:
            parcel.pending.finish_with(self._finisher(parcel.name))

    def _launch(self) -> None:
        blocks, splits = [], []
        for owner in range(self.size):
            owned = self._of_owner[owner]
            block = wire.pack_many([(self.payloads[i], self.headers[i]) for i in owned]) if owned \
                else torch.empty(0, dtype=torch.uint8)
            blocks.append(block)
            splits.append(block.numel())
            sent = [wire.packed_size(self.payloads[i], self.headers[i]) for i in owned]
            for i, nbytes in zip(owned, sent, strict=True):
                pending = self.parcels[self.segments[i].parcel].pending
                pending.bytes_sent += nbytes
                if owner != self.rank:
                    pending.wire_bytes += nbytes
        self._scatter = self.backend.alltoall_async(torch.cat(blocks), splits, f"{self.label}.s1")

    def _finisher(self, name: str) -> Callable[[], torch.Tensor]:
        def finish() -> torch.Tensor:
            if self._failure is not None:
                raise self._failure
            if self.results is None:
                try:
                    self.results = self._finish_all()
                except BaseException as error:
                    self._failure = error
                    raise
            return self.results[name]
        return finish

    def _finish_all(self) -> dict[str, torch.Tensor]:
        mine = self._of_owner[self.rank]
        received = self.backend.wait(self._scatter)
        # Every rank sent this one its own payloads of these segments, laid out as this rank's.
        per_segment = wire.unpack_gathered_many(received, [(self.payloads[i], self.headers[i]) for i in mine],
                                                self.size, f"{self.label}.s1")
        sums: list[Payload] = []
        for i, payloads in zip(mine, per_segment, strict=True):
            sums.append(self._reencode(i, payloads))
        packed = wire.pack_many([(payload, self.sum_headers[i]) for i, payload in zip(mine, sums, strict=True)]) \
            if mine else torch.empty(0, dtype=torch.uint8)
        for i, payload in zip(mine, sums, strict=True):
            self.parcels[self.segments[i].parcel].pending.bytes_sent += wire.packed_size(payload, self.sum_headers[i])
        handle = self.backend.allgather_async(packed, f"{self.label}.s2")
        gathered = self.backend.wait(handle)
        # Each owner's payloads of its segments, in owner order: the order of the segments.
        layout = [(self.payloads[i], self.sum_headers[i]) for i in range(len(self.segments))]
        owners = wire.unpack_gathered_many(gathered, layout, 1, f"{self.label}.s2")
        for i, (segment, payloads) in enumerate(zip(self.segments, owners, strict=True)):
            if segment.owner != self.rank:
                self.parcels[segment.parcel].pending.wire_bytes += wire.packed_size(payloads[0], self.sum_headers[i])
        # Every rank decodes the same owners' payloads: once, where the backend hosts them all.
        flats = computed_once(self.backend, handle, "decoded", lambda: self._decoded(owners))
        return {parcel.name: flat.view(like[0]) for parcel, flat, like in zip(self.parcels, flats, self._like,
                                                                              strict=True)}

    def _decoded(self, owners: list[list[Payload]]) -> list[torch.Tensor]:
        """Each parcel's result, flat: its segments' owner payloads decoded back to back."""
        flats = [torch.empty(shape.numel(), dtype=dtype, device=device) for shape, dtype, device in self._like]
        for i, (segment, payloads) in enumerate(zip(self.segments, owners, strict=True)):
            encoder = self.parcels[segment.parcel].compressor.for_sums()
            flats[segment.parcel][segment.start: segment.stop] = \
                encoder.decompress(payloads[0], self.contexts[i]).reshape(-1)
        return flats

    def _reencode(self, index: int, payloads: list[Payload]) -> Payload:
        """The owner's payload of segment ``index``: every rank's payloads aggregated, then
        compressed again (after the owner's error feedback, if any)."""
        segment = self.segments[index]
        parcel = self.parcels[segment.parcel]
        name = segment_name(parcel.name, segment.start, segment.stop)
        total = parcel.compressor.aggregate(payloads, self.contexts[index], self.average)
        encoder = parcel.compressor.for_sums()
        memory = self.owner_memory
        compensated = total if memory is None else memory.compensate(total, name)
        payload, ctx = encoder.compress(compensated, f"{name}.sum")
        if memory is not None:
            memory.update(compensated, name, encoder, payload, ctx)
        return payload


class ScatterGather(Communicator):
    """The two-phase compressed allreduce (see the module docstring) of each tensor, or of each
    fused bucket: for a compressor whose payload is not additive (signs, codes, entries), so that
    its link bytes stay the compressor's own share of a dense allreduce at any number of ranks.
    ``Grace(..., communicator=ScatterGather())`` forces it; ``Grace(..., communicator="auto")``
    takes it where it moves the fewest bytes.

    ``owner_feedback``: for a compressor paired with error feedback (a biased one), whether each
    owner keeps the error of its re-compression and adds it to the next step's sum (``True``, as
    DeepSpeed's compressed allreduce keeps a "server" error), or drops it (``False``: the second
    compression is then biased). Which trains better depends on the compressor: for Top-k + EF
    the kept error, for EF-signSGD none (``benchmarks/results/many_workers.md``, "Gathered against
    two-phase")."""

    route = "scattergather"
    fusable = True
    compresses = True

    def __init__(self, owner_feedback: bool = True) -> None:
        self.owner_feedback = check_flag(owner_feedback, "owner_feedback", "ScatterGather")

    def start(self, parcel: Parcel, backend: Backend, average: bool) -> Pending:
        ShardedExchange(parcel.name, [parcel], backend, average, self.owner_feedback)
        return parcel.pending

    def start_many(self, label: str, parcels: Sequence[Parcel], backend: Backend, average: bool,
                   into: torch.Tensor | None = None, pool: Any = None) -> Flight | None:
        ShardedExchange(label, parcels, backend, average, self.owner_feedback)
        return None

    def __repr__(self) -> str:
        return "ScatterGather()" if self.owner_feedback else "ScatterGather(owner_feedback=False)"


def owner_link_bytes(sizes: Sequence[int], payload_bytes: Callable[[int, int], int], world_size: int) -> float:
    """Link bytes per rank (an average over the ranks) of a scatter-gather of tensors of
    ``sizes`` elements, where ``payload_bytes(parcel, numel)`` is the packed size of a segment of
    ``numel`` elements of that parcel: each segment's payload leaves its rank towards ``P - 1`` of
    ``P`` owners once, and its owner's payload reaches ``P - 1`` ranks once."""
    total = 0.0
    for segment in segments_of(sizes, world_size):
        total += 2 * payload_bytes(segment.parcel, segment.stop - segment.start)
    return (world_size - 1) / world_size * total if world_size > 1 else 0.0


