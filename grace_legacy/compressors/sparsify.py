"""Sparsifiers that keep a fixed fraction of the entries: Top-k and Random-k."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import torch

from grace_legacy.compressors.selection import top_k_indices
from grace_legacy.core import Compressor, Knob, Payload, check_gradient

DENSITY = Knob("ratio", low=0.0, high=1.0, low_inclusive=False, high_inclusive=True, dense=1.0)

_INT32_LIMIT = 2**31


@functools.lru_cache(maxsize=65536)
def kept_count(ratio: float, numel: int) -> int:
    """``k = max(1, floor(ratio * numel))``, with ``ratio`` read as the decimal the user wrote.

    ``0.29 * 100`` is ``28.999999999999996`` in binary floating point; reading ``repr(0.29)`` as
    the exact fraction 29/100 gives the 29 the user meant.
    """
    return max(1, math.floor(Fraction(repr(float(ratio))) * numel))


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices halve their bytes; int64 only where int32 cannot address the tensor."""
    return torch.int32 if numel < _INT32_LIMIT else torch.int64


def uniform_subset(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct integers from ``range(n)``, every ``k``-subset equally likely (int64).

    A permutation of all ``n`` costs ``O(n)`` for every draw; for ``k`` well below ``n`` the
    first ``k`` distinct values of a stream of uniform draws are the same distribution (sampling
    without replacement by rejecting repeats) at ``O(k log k)``. Few draws repeat: ``k`` draws
    hold about ``k^2 / 2n`` repeats, so a stream of ``k + 2 k^2 / n + 64`` rarely needs topping up
    (by ``2 m + 64`` more draws while ``m`` distinct values are missing). ``k > n / 4`` takes the
    first ``k`` of a permutation instead.
    """
    if 4 * k > n:
        return torch.randperm(n, generator=generator)[:k]
    draws = torch.randint(n, (k + 2 * k * k // n + 64,), generator=generator)
    while True:
        # np.unique's return_index is each distinct value's first position in the stream.
        _, first = np.unique(draws.numpy(), return_index=True)
        if first.size >= k:
            return draws[torch.from_numpy(np.sort(first)[:k])]
        missing = k - first.size
        draws = torch.cat([draws, torch.randint(n, (2 * missing + 64,), generator=generator)])


class SparseContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


def densify(values: torch.Tensor, indices: torch.Tensor, ctx: SparseContext) -> torch.Tensor:
    """A zero tensor shaped by ``ctx`` holding ``values`` at the distinct flat ``indices``.

    ``scatter_`` rather than ``index_put_``: on CPU it writes the entries about twice as fast,
    from ResNet-50's 3x3 convolutions down to its biases (a per-call cost of about 11 us instead
    of 17 us). Unlike ``index_put_``, it would ignore extra values, so their counts are checked.
    """
    if values.shape != indices.shape:
        raise ValueError(f"a sparse payload needs one value per index, got {tuple(values.shape)} values "
                         f"for {tuple(indices.shape)} indices")
    out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
    out.scatter_(0, indices.long(), values)  # int32 indices only from torch 2.8 on
    return out.view(ctx.shape)


def _add_entries(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``out[indices[i]] += values[i]`` for each ``i`` in turn, rounding after every addition in
    ``out``'s dtype, as a sum of dense tensors does.

    ``scatter_add_`` adds fp32 and fp64 entries that way, 1.3-1.75x faster on CPU than
    ``index_add_`` once there are 10,000 or more (a fused bucket's). For fp16 and bf16 it sums in
    fp32 and rounds differently, so those keep ``index_add_``.
    """
    if out.dtype in (torch.float32, torch.float64):
        out.scatter_add_(0, indices.long(), values)  # int32 indices only from torch 2.8 on
    else:
        out.index_add_(0, indices, values)


def scatter_sum(payloads: Sequence[Payload], ctx: SparseContext, average: bool) -> torch.Tensor:
    """``sum_r scatter(values_r at indices_r)`` as one scatter-add over all ranks' entries.

    Entries are added in rank order into zeros, the same additions a rank-by-rank sum of the
    decompressed tensors performs, so the result is identical to that reference.
    """
    values = torch.cat([payload[0] for payload in payloads])
    indices = torch.cat([payload[1] for payload in payloads])
    out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=ctx.device)
    _add_entries(out, indices, values)
    if average:
        out /= len(payloads)
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


def scatter_sum_columns(values: torch.Tensor, indices: torch.Tensor, counts: Sequence[int],
                        contexts: Sequence[SparseContext], average: bool) -> list[torch.Tensor]:
    """:func:`scatter_sum` of consecutive members whose entries lie side by side: ``values`` and
    flat ``indices`` are ``[ranks, sum(counts)]``, member ``j`` owning the next ``counts[j]``
    columns (as a bucket packed part by part arrives, see :func:`grace_legacy.wire.pack_columns`).
    The outputs, all of ``values``' dtype and device, are slices of one zero buffer, filled by one
    scatter-add of every member's entries shifted by the member's offset in that buffer.

    The entries go in rank by rank (row-major over ``[ranks, sum k]``), and members' slices are
    disjoint, so each output element receives the same additions in the same order as from its own
    :func:`scatter_sum`: the results are identical to it, bit for bit (a NaN's sign and payload
    aside, which torch's kernels do not keep alike)."""
    starts = [0]
    for ctx in contexts:
        starts.append(starts[-1] + ctx.numel)
    if len(contexts) > 1:
        shift = torch.repeat_interleave(torch.tensor(starts[:-1], device=values.device),
                                        torch.tensor(counts, device=values.device))
        indices = indices.to(torch.int64) + shift
    out = torch.zeros(starts[-1], dtype=values.dtype, device=values.device)
    _add_entries(out, indices.reshape(-1), values.reshape(-1))
    if average:
        out /= values.shape[0]
    return [out[start: start + ctx.numel].view(ctx.shape) for ctx, start in zip(contexts, starts[:-1], strict=True)]


class EntrySparsifier(Compressor):
    """A sparsifier whose payload is ``[values, flat indices]`` with a :class:`SparseContext`:
    decoding scatters the values into zeros, aggregating scatter-adds every rank's entries."""

    sends_entries = True

    def decompress(self, payload: Payload, ctx: SparseContext) -> torch.Tensor:
        values, indices = payload
        return densify(values, indices, ctx)

    def support(self, payload: Payload, ctx: SparseContext) -> torch.Tensor:
        """The flat indices whose values ``payload`` carries (what DGC's factor masking zeroes)."""
        return payload[1].long()

    def aggregate(self, payloads: Sequence[Payload], ctx: SparseContext, average: bool) -> torch.Tensor:
        return scatter_sum(payloads, ctx, average)

    def scatter_context(self, ctx: SparseContext) -> SparseContext:
        return ctx


class TopK(EntrySparsifier):
    """Keeps the ``k = max(1, floor(ratio * n))`` entries of largest magnitude.

    Payload: ``[values, indices]`` with the signed values in the gradient's dtype and int32 indices
    (int64 for tensors of 2**31 elements or more): ``8k`` bytes for fp32. Not additive (every rank
    picks different indices), so it is gathered. Any floating dtype; pairs with ``Residual``.

    The entries are those ``torch.topk(x.abs(), k)`` picks (ties aside; NaN and infinity first),
    found by :func:`~grace_legacy.compressors.selection.top_k_indices`: a sampled threshold and one
    candidate pass instead of a selection over every entry.
    """

    knob = DENSITY

    def __init__(self, ratio: float | None = None) -> None:
        super().__init__()
        self._set_knob(ratio)

    @property
    def ratio(self) -> float | None:
        return self.knob_value

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "TopK")
        self.check_ready()
        flat = tensor.reshape(-1)
        k = kept_count(self.ratio, flat.numel())
        indices = top_k_indices(flat, k)
        values = flat.index_select(0, indices)  # several times faster than flat[indices] on CPU
        ctx = SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        return [values, indices.to(index_dtype(flat.numel()))], ctx

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        k = kept_count(self.ratio, numel)
        return [(k, dtype), (k, index_dtype(numel))]

    def recommended_memory(self):
        from grace_legacy.memories import Residual

        return Residual()


class RandomK(Compressor):
    """Keeps ``k = max(1, floor(ratio * n))`` entries chosen uniformly at random, unscaled.

    The indices are a function of ``(seed, name, step)`` alone (not of the rank), drawn from a
    private ``torch.Generator`` (the global RNG is never touched), so every rank picks the same
    ones: only the values travel, and they can be summed by an allreduce. ``step`` counts this
    tensor's compressions and is saved by :meth:`state_dict`. Pairs with ``Residual``.
    """

    knob = DENSITY
    additive = True
    sends_entries = True

    def __init__(self, ratio: float | None = None, seed: int = 0) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"RandomK: seed must be an int, got {seed!r}")
        self._set_knob(ratio)
        self.seed = seed

    @property
    def ratio(self) -> float | None:
        return self.knob_value

    def indices(self, name: str, step: int, numel: int) -> torch.Tensor:
        """The indices kept for tensor ``name`` at its ``step``-th compression (int64, distinct,
        in no particular order): a uniformly random ``k``-subset of ``range(numel)``."""
        generator = self.generator(self.seed, name, step, per_rank=False)
        return uniform_subset(numel, kept_count(self.ratio, numel), generator)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "RandomK")
        self.check_ready()
        step = self.next_step(name)
        flat = tensor.reshape(-1)
        indices = self.indices(name, step, flat.numel()).to(tensor.device)
        ctx = (indices, SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device))
        return [flat.index_select(0, indices)], ctx  # flat[indices] is slower on CPU

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        indices, shape = ctx
        return densify(payload[0], indices, shape)

    def support(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """The flat indices whose values ``payload`` carries (what DGC's factor masking zeroes)."""
        return ctx[0]

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(kept_count(self.ratio, numel), dtype)]

    def __repr__(self) -> str:
        return f"RandomK(ratio={self.ratio!r}, seed={self.seed})"

    def recommended_memory(self):
        from grace_legacy.memories import Residual

        return Residual()
