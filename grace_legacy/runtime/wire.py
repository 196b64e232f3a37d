"""The byte layout in which a payload (a list of tensors) travels through one gather: its parts
packed into one ``uint8`` buffer,

    [header]  part_0 [pad] part_1 [pad] ... [pad to 8 bytes]

* each part starts at a multiple of its element size, so a receiver views the bytes in place;
* the length is a multiple of 8, so every rank's buffer is aligned inside an allgather's result;
* ``header``, only when ranks may send payloads of different sizes, is ``1 + n_parts`` int64
  words: the buffer's length in bytes, then each part's leading dimension.

Only the leading dimension may differ between ranks; padding travels as zeros. A bucket of
header-less payloads may instead travel *by part* (:func:`pack_columns`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

_ALIGN = 8
_HEADER_DTYPE = torch.int64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _leading(part: torch.Tensor) -> int:
    return part.shape[0] if part.dim() > 0 else 1


def _row_elements(part: torch.Tensor) -> int:
    # math.prod, not part[0].numel(): a part may have zero rows (nothing above a threshold).
    return math.prod(part.shape[1:]) if part.dim() > 0 else 1


def _place(parts: Sequence[tuple[int, int]], with_header: bool) -> tuple[list[int], int]:
    """Offsets and total length for parts given as (byte length, element size)."""
    offset = (1 + len(parts)) * 8 if with_header else 0
    offsets = []
    for nbytes, element_size in parts:
        offset = _round_up(offset, element_size)
        offsets.append(offset)
        offset += nbytes
    return offsets, _round_up(offset, _ALIGN)


def layout(parts: Sequence[torch.Tensor], leading: Sequence[int], with_header: bool) -> tuple[list[int], int]:
    """Byte offset of each part and the total buffer length, for parts with the given dtypes and
    trailing shapes but leading dimensions ``leading``."""
    return _place([(rows * _row_elements(p) * p.element_size(), p.element_size())
                   for p, rows in zip(parts, leading, strict=True)], with_header)


def packed_size(parts: Sequence[torch.Tensor], with_header: bool) -> int:
    """Length in bytes of ``pack(parts, with_header)``, without packing."""
    return layout(parts, [_leading(p) for p in parts], with_header)[1]


def packed_size_of(spec: Sequence[tuple[int, torch.dtype]], with_header: bool) -> int:
    """Length in bytes of a packed payload whose parts have these (element count, dtype)."""
    sizes = []
    for numel, dtype in spec:
        element_size = dtype.itemsize
        sizes.append((numel * element_size, element_size))
    return _place(sizes, with_header)[1]


def pack(parts: Sequence[torch.Tensor], with_header: bool) -> torch.Tensor:
    """Copy ``parts`` into one aligned ``uint8`` buffer (the module's layout)."""
    return pack_many([(parts, with_header)])


def pack_many(members: Sequence[tuple[Sequence[torch.Tensor], bool]]) -> torch.Tensor:
    """``torch.cat([pack(parts, with_header) for parts, with_header in members])``, written into
    one buffer: one allocation and one copy of each part, however many members a bucket holds."""
    placed = []
    end = 0
    for parts, with_header in members:
        if not parts:
            raise ValueError("a payload must have at least one part")
        leading = [_leading(p) for p in parts]
        offsets, total = layout(parts, leading, with_header)
        placed.append((parts, with_header, leading, offsets, total, end))
        end += total
    device = members[0][0][0].device if members else torch.device("cpu")
    buffer = torch.zeros(end, dtype=torch.uint8, device=device)  # padding travels as zeros
    for parts, with_header, leading, offsets, total, base in placed:
        if with_header:
            header = torch.tensor([total, *leading], dtype=_HEADER_DTYPE, device=device)
            buffer[base: base + header.numel() * 8].copy_(header.view(torch.uint8))
        for part, start in zip(parts, offsets, strict=True):
            if part.numel():  # an empty part may carry strides that cannot be viewed as bytes
                raw = part.contiguous().reshape(-1).view(torch.uint8)
                buffer[base + start: base + start + raw.numel()].copy_(raw)
    return buffer


def unpack_gathered(gathered: torch.Tensor, like: Sequence[torch.Tensor], world_size: int,
                    with_header: bool, name: str) -> list[list[torch.Tensor]]:
    """Split the concatenation of every rank's packed buffer into one payload per rank, as views
    into ``gathered``; ``like``, the local payload, gives the dtypes and trailing shapes."""
    return unpack_gathered_many(gathered, [(like, with_header)], world_size, name)[0]


def unpack_gathered_many(gathered: torch.Tensor, members: Sequence[tuple[Sequence[torch.Tensor], bool]],
                         world_size: int, name: str) -> list[list[list[torch.Tensor]]]:
    """The gather of a bucket, every rank's members' packed buffers back to back in one member
    order, as ``payloads[member][rank]``; ``members``: each member's local payload and whether it
    carries a header. ``RuntimeError`` when the bytes do not fit the layout."""
    if not any(with_header for _, with_header in members):
        # Every rank has the local layout: one view per part covers all ranks.
        return [per_rank(parts) for parts in unpack_stacked(gathered, members, world_size, name)]
    local = []
    for like, with_header in members:
        leading = [_leading(p) for p in like]
        local.append((leading, layout(like, leading, with_header)))
    out: list[list[list[torch.Tensor]]] = [[] for _ in members]
    offset = 0
    for rank in range(world_size):
        for index, ((like, with_header), (leading, placement)) in enumerate(zip(members, local, strict=True)):
            if with_header:
                header_bytes = (1 + len(like)) * 8
                if offset + header_bytes > gathered.numel():
                    raise RuntimeError(f"truncated gather for {name!r}: rank {rank}'s header is missing")
                header = gathered[offset: offset + header_bytes].view(_HEADER_DTYPE).tolist()
                total, leading = int(header[0]), [int(v) for v in header[1:]]
                if len(leading) != len(like) or offset + total > gathered.numel():
                    raise RuntimeError(f"corrupt gather for {name!r}: rank {rank}'s header {header} does not fit")
                placement = layout(like, leading, with_header)
            offsets, expected = placement
            if (with_header and expected != total) or offset + expected > gathered.numel():
                raise RuntimeError(f"corrupt gather for {name!r}: rank {rank}'s payload needs {expected} bytes "
                                   f"at offset {offset} of {gathered.numel()}")
            out[index].append(_views(gathered, offset, like, leading, offsets))
            offset += expected
    if offset != gathered.numel():
        raise RuntimeError(f"gather for {name!r} has {gathered.numel() - offset} unexplained bytes")
    return out


def unpack_stacked(gathered: torch.Tensor, members: Sequence[tuple[Sequence[torch.Tensor], bool]],
                   world_size: int, name: str) -> list[list[torch.Tensor]]:
    """The gather of a bucket whose members travel without a header, as views into ``gathered``
    with a leading rank dimension: part ``i`` of member ``m`` on rank ``r`` is ``parts[m][i][r]``."""
    if any(with_header for _, with_header in members):
        raise ValueError(f"unpack_stacked({name!r}): members with a size header differ between ranks")
    placements = [layout(like, [_leading(p) for p in like], False) for like, _ in members]
    chunk = sum(total for _, total in placements)
    by_rank = _by_rank(gathered, chunk, world_size, name)
    out, base = [], 0
    for (like, _), (offsets, total) in zip(members, placements, strict=True):
        parts = []
        for template, start in zip(like, offsets, strict=True):
            shape = (world_size, *template.shape)
            if template.numel() == 0:
                parts.append(torch.empty(shape, dtype=template.dtype, device=gathered.device))
                continue
            span = by_rank[:, base + start: base + start + template.numel() * template.element_size()]
            parts.append(span.view(template.dtype).view(shape))
        out.append(parts)
        base += total
    return out


def _by_rank(gathered: torch.Tensor, chunk: int, world_size: int, name: str) -> torch.Tensor:
    """``gathered`` as ``[world_size, chunk]`` bytes, when every rank sent this rank's ``chunk``."""
    if gathered.numel() != chunk * world_size:
        raise RuntimeError(
            f"ranks disagree on the payload size of {name!r}: this rank sent {chunk} bytes, "
            f"the gather returned {gathered.numel()} for {world_size} ranks. Every rank must use "
            f"the same compressor configuration and model.")
    return gathered.view(world_size, chunk)


def per_rank(stacked: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """One payload per rank from parts stacked along a leading rank dimension."""
    return [list(parts) for parts in zip(*(part.unbind(0) for part in stacked), strict=True)]


def _views(buffer: torch.Tensor, base: int, like: Sequence[torch.Tensor], leading: Sequence[int],
           offsets: Sequence[int]) -> list[torch.Tensor]:
    """The parts of the packed payload at ``buffer[base:]`` (byte ``offsets`` from there), as
    views in the local parts' dtypes and trailing shapes with ``leading`` rows."""
    parts = []
    for template, rows, start in zip(like, leading, offsets, strict=True):
        count = rows * _row_elements(template)
        if count == 0:
            parts.append(torch.empty((rows, *template.shape[1:]), dtype=template.dtype, device=buffer.device))
            continue
        flat = buffer[base + start: base + start + count * template.element_size()].view(template.dtype)
        parts.append(flat.view(rows, *template.shape[1:]) if template.dim() > 0 else flat.view(()))
    return parts


class Columns(NamedTuple):
    """Where :func:`pack_columns` puts a bucket's payloads: column ``c`` (every payload's part
    ``c``, flattened, back to back) holds ``dtypes[c]`` from byte ``offsets[c]``, payload ``m``'s
    part taking ``counts[c][m]`` elements of it; the buffer is ``nbytes`` long."""

    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]
    nbytes: int


def columns(payloads: Sequence[Sequence[torch.Tensor]]) -> Columns | None:
    """The layout :func:`pack_columns` gives ``payloads`` (columns aligned to their element size, a
    length that is a multiple of 8), or ``None`` where the parts do not line up in number and dtype."""
    if not payloads or not payloads[0] or any(len(p) != len(payloads[0]) for p in payloads):
        return None
    dtypes = tuple(part.dtype for part in payloads[0])
    if any(part.dtype != dtype for payload in payloads for part, dtype in zip(payload, dtypes, strict=True)):
        return None
    counts = tuple(tuple(payload[c].numel() for payload in payloads) for c in range(len(dtypes)))
    sizes = [dtype.itemsize for dtype in dtypes]
    offsets, nbytes = _place([(sum(n) * size, size) for n, size in zip(counts, sizes, strict=True)], False)
    return Columns(dtypes, tuple(offsets), counts, nbytes)


def pack_columns(payloads: Sequence[Sequence[torch.Tensor]], layout: Columns) -> torch.Tensor:
    """``payloads`` packed by part into one ``uint8`` buffer laid out as ``layout``
    (:func:`columns` of them): one ``torch.cat`` per column, padding as zeros."""
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=payloads[0][0].device)
    for c, (dtype, offset, counts) in enumerate(zip(layout.dtypes, layout.offsets, layout.counts, strict=True)):
        total = sum(counts)
        if total:
            torch.cat([payload[c].reshape(-1) for payload in payloads],
                      out=buffer[offset: offset + total * dtype.itemsize].view(dtype))
    return buffer


def unpack_columns(gathered: torch.Tensor, layout: Columns, world_size: int, name: str) -> list[torch.Tensor]:
    """The gather of buffers packed as ``layout`` by every rank: each column over all ranks, as
    a ``[world_size, elements]`` view into ``gathered`` in the column's dtype."""
    by_rank = _by_rank(gathered, layout.nbytes, world_size, name)
    out = []
    for dtype, offset, counts in zip(layout.dtypes, layout.offsets, layout.counts, strict=True):
        total = sum(counts)
        if total:
            out.append(by_rank[:, offset: offset + total * dtype.itemsize].view(dtype))
        else:
            out.append(torch.empty((world_size, 0), dtype=dtype, device=gathered.device))
    return out
