"""One FSDP2 unit's gradients reduce-scattered compressed: every rank encodes its gradient segment
by segment, one all-to-all takes each owner its shard's payloads, each owner decodes and combines.

With ``P`` ranks, rank ``q``'s unsharded gradient ``g_q`` of a parameter is cut into the segments
FSDP's flat input holds (:mod:`grace_legacy.fsdp.layout`): ``g_q = [s_q^0; ...; s_q^{P-1}]``, the
padding left out. The compressor ``C`` is chosen per parameter, from its full shape, name and the
training's progress (so LEGACY's size groups and every value of a schedule are the parameter's),
and encodes each segment as a tensor of its own under the segment's name, after the memory's
compensation of that segment:

    x_q^r = M_q.compensate(s_q^r),   p_q^r = C(x_q^r),   M_q.update(x_q^r, D(p_q^r))

Rank ``q`` sends ``p_q^r`` to owner ``r`` (one ``all_to_all_single`` for the unit, each owner's
payloads packed back to back, :mod:`grace_legacy.runtime.wire`; the receive counts are exchanged
first only where a payload's size is data-decided). Owner ``r`` combines what every rank sent it by
the compressor's own rule, in fp32 at least, and applies FSDP's reduce op:

    shard_r = factor * A_q D(p_q^r)      A: the sum (or the mean, for ``AVG``); a vote for signSGD

``AVG`` is the mean; ``PREMUL_SUM(f)`` (a gradient divide factor) is ``f`` times the sum; ``SUM``
(FSDP divides itself before and after, for fp16) the sum. A majority vote is not a sum: it stands
for the mean, so ``AVG`` returns it as it is, and the other ops scale it as they scale a mean. The
memory's ``aggregated`` then sees the owner's segments only (EF21's global estimate is the
owner's). A parameter the compressor leaves dense, or whose payloads would put no fewer bytes on
the link than its dense segments (the dense fallback), travels as its raw segments in the same
all-to-all and is summed in fp32.

Link bytes per rank: the payloads of the ``P - 1`` segments sent to other owners, where FSDP's
reduce-scatter sends ``(P - 1) / P`` of the padded flat: the compressor's own ratio, at any ``P``.
Each owner's block also carries one 8-byte word: whether the sender's gradient (or its compensated
form) held an inf or NaN. Where any rank's did, every owner fills its shard with NaN, so a
``GradScaler`` skips the step on every rank, and every rank knows the unit was non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grace_legacy.communicators.scatter_gather import segment_name
from grace_legacy.compressors import NoCompression
from grace_legacy.core.backend import Backend
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import NoMemory
from grace_legacy.fsdp.layout import Piece
from grace_legacy.grace import Grace
from grace_legacy.runtime import paths, wire
from grace_legacy.runtime.validation import nonfinite_flag

_DENSE = NoCompression()
#: The word each owner's block starts with: the sender's non-finite flag.
FLAG_BYTES = 8
#: The dtypes an owner sums in as they are; narrower ones are summed in fp32.
_WIDE = (torch.float32, torch.float64)


def reduction_of(op: Any, world_size: int) -> tuple[bool, float]:
    """``(average, factor)`` such that FSDP's reduce op ``op`` asks for ``factor`` times the mean
    (``average``) or the sum of the ranks' gradients. ``ValueError`` for an op that is no sum."""
    kind = op.op if hasattr(op, "op") else op
    if kind == dist.ReduceOp.AVG:
        return True, 1.0
    if kind == dist.ReduceOp.SUM:
        return False, 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = op.factor
        return False, float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    raise ValueError(f"grace_legacy.fsdp: FSDP asked for a reduce-scatter with {kind!r}; only SUM, AVG and "
                     f"PREMUL_SUM (a gradient divide factor) are sums a compressed reduce-scatter can compute")


@dataclass
class Encoded:
    """One parameter of the unit on this rank: its route and each owner's payload (``None``
    where the owner's chunk is all padding)."""

    piece: Piece
    compressor: Compressor
    route: str
    payloads: list[Payload | None] = field(default_factory=list)
    contexts: list[Any] = field(default_factory=list)

    @property
    def header(self) -> bool:
        return not self.compressor.traits.uniform_payload


@dataclass
class Outcome:
    """What a unit's exchange leaves for the end of the step."""

    #: the segment names whose memory and compressor state this step changed
    names: list[str]
    #: a 0-dim bool tensor: whether any rank's gradient of the unit held an inf or NaN
    nonfinite: torch.Tensor
    #: bytes of the send and receive buffers this exchange held at once
    buffer_bytes: int


def choose_route(grace: Grace, piece: Piece, like: torch.Tensor, world_size: int,
                 cache: dict[tuple, tuple[Compressor, str]]) -> tuple[Compressor, str]:
    """The compressor and route of ``piece`` this step: dense where the bundle's compressor leaves
    it uncompressed, the dense fallback where its payloads would be at least its dense segments
    (size fixed by the configuration, a mean for an aggregate), the compressed reduce-scatter
    otherwise. A function of what every rank shares."""
    full = like.new_zeros(()).expand(piece.shape)
    concrete = grace.compressor.compressor_for(full, piece.name) if piece.numel else None
    if concrete is None:
        return _DENSE, "dense"
    key = (id(concrete), piece, like.dtype, world_size)
    cached = cache.get(key)
    if cached is not None:
        return cached
    route = "reducescatter"
    if grace.dense_fallback and concrete.traits.aggregates_by_mean:
        try:
            packed = dense = 0
            for owner in range(world_size):
                shape = piece.segment_shape(owner)
                if shape.numel():
                    packed += wire.packed_size_of(concrete.payload_spec_for(shape, like.dtype), not
                                                  concrete.traits.uniform_payload)
                    dense += wire.packed_size_of([(shape.numel(), like.dtype)], False)
        except NotImplementedError:  # a size only the data decides: every rank could decide differently
            packed, dense = 0, 1
        if packed >= dense:
            concrete, route = _DENSE, "dense-fallback"
    cache[key] = (concrete, route)
    return concrete, route


def encode(grace: Grace, pieces: Sequence[Piece], flat: torch.Tensor, world_size: int,
           cache: dict[tuple, tuple[Compressor, str]], names: list[str]) -> tuple[list[Encoded], torch.Tensor]:
    """Every piece's segments compensated, compressed and learnt from by the memory, each segment's
    name added to ``names`` as its state changes; the local non-finite flag (the gradient's, and
    the compensated segments' where a memory adds state)."""
    rows = flat.view(world_size, -1)
    memory = grace.memory
    flags = [nonfinite_flag(flat)]
    watch = not isinstance(memory, NoMemory)
    encoded = []
    for piece in pieces:
        compressor, route = choose_route(grace, piece, flat, world_size, cache)
        item = Encoded(piece, compressor, route)
        for owner in range(world_size):
            shape = piece.segment_shape(owner)
            if not shape.numel():
                item.payloads.append(None)
                item.contexts.append(None)
                continue
            segment = rows[owner, piece.offset: piece.offset + shape.numel()].view(shape)
            name = segment_name(piece.name, *piece.span(owner))
            names.append(name)
            compensated = memory.compensate(segment, name)
            if watch:
                flags.append(nonfinite_flag(compensated))
            payload, ctx = compressor.compress(compensated, name)
            memory.update(compensated, name, compressor, payload, ctx)
            item.payloads.append(payload)
            item.contexts.append(ctx)
        encoded.append(item)
    return encoded, torch.stack(flags).any()


def _flag_word(flag: torch.Tensor) -> torch.Tensor:
    word = torch.zeros(FLAG_BYTES, dtype=torch.uint8, device=flag.device)
    word[0] = flag.to(torch.uint8)  # a device tensor's value, copied without a host round trip
    return word


def exchange(backend: Backend, encoded: Sequence[Encoded], flag: torch.Tensor, label: str
             ) -> tuple[list[list[list[torch.Tensor]]], list[Encoded], int]:
    """One all-to-all: owner ``r`` gets every rank's flag and payloads of its segments. Returns the
    received payloads (``[member][rank]``, the flag word first), the pieces with segments here,
    and the bytes of the buffers sent and received."""
    size, rank = backend.size(), backend.rank()
    word = _flag_word(flag)
    blocks = []
    for owner in range(size):
        members = [([word], False)] + [(item.payloads[owner], item.header) for item in encoded
                                        if item.payloads[owner] is not None]
        blocks.append(wire.pack_many(members))
    mine = [item for item in encoded if item.payloads[rank] is not None]
    layout = [([word], False)] + [(item.payloads[rank], item.header) for item in mine]
    # Every rank's block for this owner has this rank's own layout, unless a size is data-decided
    # somewhere in the unit: then every rank exchanges the counts (all of them, or none: one collective).
    known = None if any(item.header for item in encoded) else [blocks[rank].numel()] * size
    sent = torch.cat(blocks)
    received = backend.wait(backend.alltoall_async(sent, [block.numel() for block in blocks], label,
                                                   received=known))
    return wire.unpack_gathered_many(received, layout, size, label), mine, sent.numel() + received.numel()


def combine(compressor: Compressor, payloads: list[Payload], ctx: Any, average: bool, factor: float,
            dtype: torch.dtype) -> torch.Tensor:
    """Every rank's payload of one segment combined by the compressor's rule, in fp32 at least,
    as FSDP's op asks (module docstring)."""
    world_size = len(payloads)
    if not compressor.traits.aggregates_by_mean:  # a vote stands for the mean
        total = compressor.aggregate(payloads, ctx, True)
        scale = factor if average else factor * world_size
        return total if scale == 1 else total * scale
    if dtype in _WIDE:
        total = compressor.aggregate(payloads, ctx, average)
    else:
        total = compressor.decompress(payloads[0], ctx).to(torch.float32)
        for payload in payloads[1:]:
            total = total + compressor.decompress(payload, ctx).to(torch.float32)
        if average:
            total = total / world_size
    return total if factor == 1 else total * factor


def reduce_scatter(grace: Grace, backend: Backend, pieces: Sequence[Piece], output: torch.Tensor,
                   flat: torch.Tensor, op: Any, label: str, cache: dict[tuple, tuple[Compressor, str]],
                   names: list[str]) -> Outcome:
    """Write this rank's shard of the unit's reduced gradients into ``output`` (module docstring),
    and record each parameter's traffic in the bundle's stats; ``names`` receives the segment
    names whose state changes, as they change (a failed call's are there to undo)."""
    size, rank = backend.size(), backend.rank()
    average, factor = reduction_of(op, size)
    encoded, flag = encode(grace, pieces, flat, size, cache, names)
    received, mine, buffer_bytes = exchange(backend, encoded, flag, label)
    flags, payloads_of = received[0], dict(zip((id(item) for item in mine), received[1:], strict=True))
    nonfinite = torch.stack([word[0][0] for word in flags]).ne(0).any()
    for item in encoded:
        piece = item.piece
        shard = output[piece.offset: piece.offset + piece.width]
        if item.payloads[rank] is not None:
            total = combine(item.compressor, payloads_of[id(item)], item.contexts[rank], average, factor, output.dtype)
            result = grace.memory.aggregated(segment_name(piece.name, *piece.span(rank)), total)
            real = piece.segment_shape(rank).numel()
            shard[:real].copy_(result.reshape(-1))
            shard[real:].zero_()
        else:
            shard.zero_()
        _record(grace, item, rank, size, flat)
    if paths.cpu_path(output):
        if bool(nonfinite):
            output.fill_(float("nan"))
    else:  # no host round trip on a device: the flag decides on the device
        output.masked_fill_(nonfinite, float("nan"))
    return Outcome(names, nonfinite, buffer_bytes)


def _record(grace: Grace, item: Encoded, rank: int, world_size: int, like: torch.Tensor) -> None:
    """The parameter's bytes: handed (every segment's packed payload, this owner's own included)
    and on the link (those sent to other owners), against FSDP's dense reduce-scatter, which
    sends ``P - 1`` of the ``P`` padded chunks."""
    piece = item.piece
    handed = wire_bytes = 0
    for owner, payload in enumerate(item.payloads):
        if payload is not None:
            nbytes = wire.packed_size(payload, item.header)
            handed += nbytes
            if owner != rank:
                wire_bytes += nbytes
    if piece.offset == 0:  # the unit's flag words, once per unit
        handed += FLAG_BYTES * world_size
        wire_bytes += FLAG_BYTES * (world_size - 1)
    dense_link = (world_size - 1) * piece.width * like.element_size()
    grace.record_traffic(piece.name, like.new_zeros(()).expand(piece.shape), handed, item.route, wire_bytes,
                         world_size, dense_link=dense_link)
