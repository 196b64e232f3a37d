"""An independent reference of the compressed reduce-scatter of one FSDP2 unit (grace_legacy.fsdp).

Written from FSDP's definition of the flat it hands a reduce-scatter and from the algorithm, not
from ``grace_legacy.fsdp``: the flat, viewed as ``(P, -1)``, holds in row ``r`` the ``r``-th
``torch.chunk`` of each gradient along dimension 0 after padding that dimension with zero rows to
a multiple of ``P`` (``ceil(n / P)`` rows each), parameter after parameter. Each rank compresses
the real rows of every chunk as a tensor of its own, named ``"{name}[{start}:{stop}]"`` by its
flat element range, after its memory's compensation, with the compressor its twin chooses for the
whole parameter (``None``: the raw values); a parameter whose payloads, packed on the wire (each
part at a multiple of its element size, the whole at a multiple of 8 bytes, a header of one int64
per part plus one where a size is data-decided), would take no fewer bytes than its raw chunks is
sent raw (for a mean aggregate only). Owner ``r`` combines every rank's decoded chunk ``r``:
the rank-ordered sum in fp32 (in the gradient's dtype where it is wider) times the op's factor,
divided by ``P`` for ``AVG``, or a majority vote (ties 0) scaled as the op scales a mean; then its
memory's ``aggregated``. Padding is zero. Only the compressors' and memories' own methods are the
library's (each checked against its own reference elsewhere), called on each rank's twin under the
same names, so the random draws match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grace_legacy.core.traits import Traits

#: where a compressor leaves a parameter dense (its twin's ``compressor_for`` returned ``None``)
RAW = None


@dataclass
class Param:
    name: str
    shape: torch.Size  # the gradient's shape along dimension 0, as FSDP lays it out

    def chunk_rows(self, world: int) -> int:
        return math.ceil(self.shape[0] / world)

    def width(self, world: int) -> int:
        return self.chunk_rows(world) * math.prod(self.shape[1:])

    def rows_of(self, owner: int, world: int) -> int:
        c = self.chunk_rows(world)
        return max(0, min(self.shape[0], (owner + 1) * c) - owner * c)


def offsets(params: Sequence[Param], world: int) -> list[int]:
    out, at = [], 0
    for p in params:
        out.append(at)
        at += p.width(world)
    return out


def full_gradient(flat: torch.Tensor, params: Sequence[Param], world: int, index: int) -> torch.Tensor:
    """Parameter ``index``'s gradient read back from a flat reduce-scatter input (the padding dropped)."""
    rows = flat.reshape(world, -1)
    start = offsets(params, world)[index]
    p = params[index]
    chunks = rows[:, start: start + p.width(world)].reshape(world * p.chunk_rows(world), *p.shape[1:])
    return chunks[: p.shape[0]]


def _aligned(nbytes: int, element: int) -> int:
    return -(-nbytes // element) * element


def wire_bytes(spec: Sequence[tuple[int, torch.dtype]], header: bool) -> int:
    at = 8 * (1 + len(spec)) if header else 0
    for numel, dtype in spec:
        at = _aligned(at, dtype.itemsize) + numel * dtype.itemsize
    return _aligned(at, 8)


def goes_raw(compressor: Any, p: Param, world: int, dtype: torch.dtype) -> bool:
    if not compressor.traits.aggregates_by_mean:
        return False
    packed = raw = 0
    for owner in range(world):
        rows = p.rows_of(owner, world)
        if rows == 0:
            continue
        shape = torch.Size([rows, *p.shape[1:]])
        try:
            packed += wire_bytes(compressor.payload_spec_for(shape, dtype), not compressor.traits.uniform_payload)
        except NotImplementedError:
            return False
        raw += wire_bytes([(shape.numel(), dtype)], False)
    return packed >= raw


class Twin:
    """One rank's side: its twin compressor and memory, and what it encoded this step."""

    def __init__(self, compressor: Any, memory: Any, rank: int, fallback: bool = True) -> None:
        self.compressor, self.memory, self.fallback = compressor, memory, fallback
        compressor.set_rank(rank)

    def encode(self, flat: torch.Tensor, params: Sequence[Param], world: int) -> list[list[Any]]:
        """``[param][owner]``: (decoded chunk, compressor or RAW), or None for an all-padding chunk."""
        rows = flat.reshape(world, -1)
        out = []
        for p, start in zip(params, offsets(params, world), strict=True):
            compressor = self.compressor.compressor_for(flat.new_zeros(p.shape), p.name)
            if compressor is not None and self.fallback and goes_raw(compressor, p, world, flat.dtype):
                compressor = RAW
            per_owner = []
            for owner in range(world):
                n = p.rows_of(owner, world)
                if n == 0:
                    per_owner.append(None)
                    continue
                numel = n * math.prod(p.shape[1:])
                segment = rows[owner, start: start + numel].reshape(n, *p.shape[1:]).clone()
                first = owner * p.width(world)
                name = f"{p.name}[{first}:{first + numel}]"
                compensated = self.memory.compensate(segment, name)
                if compressor is RAW:
                    payload, ctx, decoded = [compensated], None, compensated.clone()
                    self.memory.update(compensated, name, _Raw(), payload, ctx)
                else:
                    payload, ctx = compressor.compress(compensated, name)
                    decoded = compressor.decompress(payload, ctx).clone()
                    self.memory.update(compensated, name, compressor, payload, ctx)
                per_owner.append((decoded, compressor))
            out.append(per_owner)
        return out

    def end_step(self) -> None:
        self.memory.end_step()
        if hasattr(self.compressor, "end_step"):
            self.compressor.end_step()


class _Raw:
    """The raw values as a 'compressor' a memory learns from: nothing was dropped."""

    traits = Traits(lossless=True)

    def decompress(self, payload, ctx):
        return payload[0]


def combine(decoded: list[torch.Tensor], compressor: Any, op: tuple[bool, float], dtype: torch.dtype) -> torch.Tensor:
    """Owner's rule over every rank's decoded chunk, rank order (module docstring)."""
    average, factor = op
    world = len(decoded)
    if compressor is not RAW and not compressor.traits.aggregates_by_mean:
        votes = sum(torch.sign(d).to(torch.int32) for d in decoded)
        scale = factor if average else factor * world
        return torch.sign(votes).to(decoded[0].dtype) * scale
    wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    total = decoded[0].to(wide).clone()
    for d in decoded[1:]:
        total += d.to(wide)
    if average:
        total /= world
    return total * factor if factor != 1 else total


def owner_shard(encoded_by_rank: list[list[list[Any]]], params: Sequence[Param], world: int, owner: int,
                op: tuple[bool, float], dtype: torch.dtype, memory: Any) -> torch.Tensor:
    """Owner ``owner``'s reduced shard (padding zero), from every rank's :meth:`Twin.encode`."""
    shard = torch.zeros(sum(p.width(world) for p in params), dtype=dtype)
    for index, (p, start) in enumerate(zip(params, offsets(params, world), strict=True)):
        items = [encoded_by_rank[rank][index][owner] for rank in range(world)]
        if items[0] is None:
            continue
        total = combine([decoded for decoded, _ in items], items[0][1], op, dtype)
        first = owner * p.width(world)
        result = memory.aggregated(f"{p.name}[{first}:{first + total.numel()}]", total)
        shard[start: start + total.numel()] = result.reshape(-1).to(dtype)
    return shard


def op_of(kind: str, factor: float | None, world: int) -> tuple[bool, float]:
    """(average, factor) of FSDP's reduction: ``AVG`` the mean; a divide factor ``f`` (PREMUL_SUM)
    ``1 / f`` times the sum; ``SUM`` the sum."""
    if kind == "avg":
        return True, 1.0
    if kind == "premul":
        return False, 1.0 / factor
    return False, 1.0
