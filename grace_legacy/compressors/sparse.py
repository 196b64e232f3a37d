"""Sparse payloads (values at flat indices) decoded and summed over ranks.

Top-k, DGC, Threshold and Random-k decode through :func:`densify`; the gathered ones aggregate
through the scatter sums here, which a fused bucket also uses to sum all its members at once
(:mod:`grace_legacy.communicators.exchange`). Every sum adds the entries rank by rank into zeros, the
same additions a rank-by-rank sum of decoded tensors makes, so the results are identical to it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from grace_legacy.core.compressor import Payload

_INT32_LIMIT = 2**31
#: ``scatter_``/``scatter_add_`` take int32 indices from torch 2.8 on; before, they must be widened
#: first, which costs a pass over the indices and a buffer twice their size.
_SCATTER_TAKES_INT32 = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)


def scatter_indices(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` as ``scatter_`` accepts them: as they are where it can, widened to int64 where not."""
    return indices if _SCATTER_TAKES_INT32 or indices.dtype == torch.int64 else indices.long()


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices halve their bytes; int64 only where int32 cannot address the tensor."""
    return torch.int32 if numel < _INT32_LIMIT else torch.int64


class SparseContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


def zeros_for(ctx: SparseContext, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, checked to be a 1-D tensor that can hold ``ctx``'s entries (the caller promises it
    is all zeros: e.g. from :class:`grace_legacy.runtime.buffers.BufferPool`), or new zeros."""
    if out is None:
        return torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
    if out.shape != (ctx.numel,) or out.dtype != ctx.dtype or out.device != ctx.device:
        raise ValueError(f"out must be a 1-D {ctx.dtype} tensor of {ctx.numel} elements on {ctx.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def densify(values: torch.Tensor, indices: torch.Tensor, ctx: SparseContext,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """A zero tensor shaped by ``ctx`` holding ``values`` at the distinct flat ``indices``.

    ``scatter_`` rather than ``index_put_``: on CPU it writes the entries faster, from large
    convolutions down to biases. Unlike ``index_put_``, it would ignore extra values, so their
    counts are checked. ``out``: the zeros to fill (see :func:`zeros_for`); ``None`` makes them.
    """
    if values.shape != indices.shape:
        raise ValueError(f"a sparse payload needs one value per index, got {tuple(values.shape)} values "
                         f"for {tuple(indices.shape)} indices")
    out = zeros_for(ctx, out)
    out.scatter_(0, scatter_indices(indices), values)
    return out.view(ctx.shape)


def _add_entries(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out[indices[i]] += values[i]`` for each ``i`` in turn, rounding after every addition in
    ``out``'s dtype, as a sum of dense tensors does.

    ``scatter_add_`` adds fp32 and fp64 entries that way, and faster on CPU than ``index_add_``
    once there are many (a fused bucket's). For fp16 and bf16 it sums in fp32 and rounds once, so
    the result would differ from a sum of decoded tensors: those keep ``index_add_``.
    """
    if out.dtype in (torch.float32, torch.float64):
        out.scatter_add_(0, scatter_indices(indices), values)
    else:
        out.index_add_(0, indices, values)


def divide_written(out: torch.Tensor, indices: torch.Tensor, divisor: int) -> None:
    """``out /= divisor`` for an ``out`` that is zero except at ``indices`` (repeats allowed): where
    those are few, only those entries are divided (a zero divided stays the same zero), the same
    division of the same numbers, so the same tensor, without a pass over all of ``out``."""
    if 4 * indices.numel() >= out.numel():
        out /= divisor
        return
    # Gathered before any is written, so an index given twice gets the same quotient twice.
    indices = scatter_indices(indices)
    out.scatter_(0, indices, out.gather(0, indices) / divisor)


def scatter_sum(payloads: Sequence[Payload], ctx: SparseContext, average: bool,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_r scatter(values_r at indices_r)`` as one scatter-add over all ranks' entries.

    Entries are added in rank order into zeros, the same additions a rank-by-rank sum of the
    decompressed tensors performs, so the result is identical to that reference. ``out``: as for
    :func:`densify`.
    """
    values = torch.cat([payload[0] for payload in payloads])
    indices = torch.cat([payload[1] for payload in payloads])
    out = zeros_for(ctx, out)
    _add_entries(out, indices, values)
    if average:
        divide_written(out, indices, len(payloads))
    return out.view(ctx.shape)


def scatter_sum_many(members: Sequence[tuple[torch.Tensor, torch.Tensor, SparseContext]],
                     average: bool) -> list[torch.Tensor]:
    """:func:`scatter_sum` of many tensors at once, from their stacked entries (``[ranks, k]``
    values and flat indices, with the :class:`SparseContext`): the members of one dtype and device
    go through one :func:`scatter_sum_columns`."""
    results: list[torch.Tensor | None] = [None] * len(members)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, (_, _, ctx) in enumerate(members):
        groups.setdefault((ctx.dtype, ctx.device), []).append(index)
    for group in groups.values():
        if len(group) == 1:
            values, indices, _ = members[group[0]]
        else:
            values = torch.cat([members[i][0] for i in group], dim=1)
            indices = torch.cat([members[i][1] for i in group], dim=1)
        sums = scatter_sum_columns(values, indices, [members[i][1].shape[1] for i in group],
                                   [members[i][2] for i in group], average)
        for i, total in zip(group, sums, strict=True):
            results[i] = total
    return results  # type: ignore[return-value]


def _starts(contexts: Sequence[SparseContext]) -> list[int]:
    starts = [0]
    for ctx in contexts:
        starts.append(starts[-1] + ctx.numel)
    return starts


def bucket_positions(indices: torch.Tensor, counts: Sequence[int], contexts: Sequence[SparseContext]) -> torch.Tensor:
    """Where :func:`scatter_sum_columns` adds each entry of ``indices`` (``[ranks, sum(counts)]``
    flat indices, member ``j`` owning the next ``counts[j]`` columns): its index shifted by its
    member's offset in the one buffer of all members."""
    if len(contexts) == 1:
        return indices
    starts = _starts(contexts)
    shift = torch.repeat_interleave(torch.tensor(starts[:-1], device=indices.device),
                                    torch.tensor(counts, device=indices.device))
    return indices.to(torch.int64) + shift


def scatter_sum_columns(values: torch.Tensor, indices: torch.Tensor, counts: Sequence[int],
                        contexts: Sequence[SparseContext], average: bool,
                        out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """:func:`scatter_sum` of consecutive members whose entries lie side by side: ``values`` and
    flat ``indices`` are ``[ranks, sum(counts)]``, member ``j`` owning the next ``counts[j]``
    columns (as a bucket packed part by part arrives, see :func:`grace_legacy.runtime.wire.pack_columns`).
    The outputs, all of ``values``' dtype and device, are slices of one zero buffer, filled by one
    scatter-add of every member's entries shifted by the member's offset in that buffer.

    The entries go in rank by rank (row-major over ``[ranks, sum k]``), and members' slices are
    disjoint, so each output element receives the same additions in the same order as from its own
    :func:`scatter_sum`: the results are identical to it, bit for bit (a NaN's sign and payload
    aside, which torch's kernels do not keep alike).

    ``out``: the buffer to fill (1-D, ``sum(ctx.numel)`` zeros of ``values``' dtype and device),
    e.g. one kept from an earlier step (:mod:`grace_legacy.runtime.buffers`); ``None`` makes one."""
    starts = _starts(contexts)
    indices = bucket_positions(indices, counts, contexts)
    if out is None:
        out = torch.zeros(starts[-1], dtype=values.dtype, device=values.device)
    elif out.shape != (starts[-1],) or out.dtype != values.dtype or out.device != values.device:
        raise ValueError(f"scatter_sum_columns: out must be a 1-D {values.dtype} tensor of {starts[-1]} elements "
                         f"on {values.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    flat_indices = indices.reshape(-1)
    _add_entries(out, flat_indices, values.reshape(-1))
    if average:
        divide_written(out, flat_indices, values.shape[0])
    return [out[start: start + ctx.numel].view(ctx.shape) for ctx, start in zip(contexts, starts[:-1], strict=True)]
