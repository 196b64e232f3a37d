"""Sparse payloads (values at flat indices) decoded and summed over ranks. Every sum adds the
entries rank by rank into zeros, the same additions a rank-by-rank sum of decoded tensors makes, so
the results are identical to it (docs/DESIGN.md#sparse-sums)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from grace_legacy.compressors.kernels import scatter
from grace_legacy.compressors.kernels.scatter import scatter_indices
from grace_legacy.core.compressor import Payload

_INT32_LIMIT = 2**31


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices halve their bytes; int64 only where int32 cannot address the tensor."""
    return torch.int32 if numel < _INT32_LIMIT else torch.int64


class SparseContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


def zeros_for(ctx: SparseContext, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, checked to be a 1-D tensor that can hold ``ctx``'s entries (all zeros, the caller
    promises), or new zeros; ``ValueError`` if it cannot."""
    if out is None:
        return torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
    if out.shape != (ctx.numel,) or out.dtype != ctx.dtype or out.device != ctx.device:
        raise ValueError(f"out must be a 1-D {ctx.dtype} tensor of {ctx.numel} elements on {ctx.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def densify(values: torch.Tensor, indices: torch.Tensor, ctx: SparseContext,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """A zero tensor shaped by ``ctx`` holding ``values`` at the distinct flat ``indices`` (counts
    checked: ``ValueError``), filled into ``out`` (see :func:`zeros_for`) or new zeros."""
    if values.shape != indices.shape:
        raise ValueError(f"a sparse payload needs one value per index, got {tuple(values.shape)} values "
                         f"for {tuple(indices.shape)} indices")
    out = zeros_for(ctx, out)
    scatter.put(out, indices, values)
    return out.view(ctx.shape)


def _add_entries(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out[indices[i]] += values[i]`` for each ``i`` in turn, rounding after every addition in
    ``out``'s dtype, as a sum of dense tensors does (``scatter_add_`` would sum fp16/bf16 in fp32)."""
    if out.dtype in (torch.float32, torch.float64):
        out.scatter_add_(0, scatter_indices(indices), values)
    else:
        out.index_add_(0, indices, values)


def divide_written(out: torch.Tensor, indices: torch.Tensor, divisor: int) -> None:
    """``out /= divisor`` for an ``out`` that is zero except at ``indices`` (repeats allowed), the
    same tensor; where those are few, only they are divided."""
    if 4 * indices.numel() >= out.numel():
        out /= divisor
        return
    # Gathered before any is written, so an index given twice gets the same quotient twice.
    indices = scatter_indices(indices)
    out.scatter_(0, indices, out.gather(0, indices) / divisor)


def scatter_sum(payloads: Sequence[Payload], ctx: SparseContext, average: bool,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_r scatter(values_r at indices_r)`` as one scatter-add over all ranks' entries, identical
    to the rank-by-rank sum of the decoded tensors; ``out`` as for :func:`densify`."""
    values = torch.cat([payload[0] for payload in payloads])
    indices = torch.cat([payload[1] for payload in payloads])
    out = zeros_for(ctx, out)
    _add_entries(out, indices, values)
    if average:
        divide_written(out, indices, len(payloads))
    return out.view(ctx.shape)


def scatter_sum_many(members: Sequence[tuple[torch.Tensor, torch.Tensor, SparseContext]],
                     average: bool) -> list[torch.Tensor]:
    """:func:`scatter_sum` of many tensors from their stacked ``[ranks, k]`` values and indices: one
    :func:`scatter_sum_columns` per dtype and device."""
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
    """Where :func:`scatter_sum_columns` adds each entry of ``indices``: shifted by its member's
    offset in the one buffer of all members."""
    if len(contexts) == 1:
        return indices
    starts = _starts(contexts)
    # output_size spares repeat_interleave a pass to size its output, which on a CPU with several
    # threads costs milliseconds even for a few entries.
    shift = torch.repeat_interleave(torch.tensor(starts[:-1], device=indices.device),
                                    torch.tensor(counts, device=indices.device), output_size=sum(counts))
    return indices.to(torch.int64) + shift


def scatter_sum_columns(values: torch.Tensor, indices: torch.Tensor, counts: Sequence[int],
                        contexts: Sequence[SparseContext], average: bool,
                        out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """:func:`scatter_sum` of consecutive members whose ``[ranks, sum(counts)]`` values and flat
    indices lie side by side, member ``j`` owning the next ``counts[j]`` columns (a bucket packed by
    part). The outputs are disjoint slices of one zero buffer (``out``, 1-D ``sum(ctx.numel)``
    zeros, or a new one) filled by one scatter-add, rank by rank: each equals its own
    :func:`scatter_sum` bit for bit (a NaN's sign and payload aside)."""
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
