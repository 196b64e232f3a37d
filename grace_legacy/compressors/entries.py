"""What the sparsifiers that send a subset of the entries share: the density parameter, ``k``, and the
base class of those whose payload is ``[values, flat indices]``."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction

import torch

from grace_legacy.compressors.sparse import SparseContext, densify, scatter_sum
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.runtime.buffers import LARGE, BufferPool

DENSITY = ScheduledParameter("ratio", low=0.0, high=1.0, low_inclusive=False, high_inclusive=True, dense=1.0)


@functools.lru_cache(maxsize=65536)
def kept_count(ratio: float, numel: int) -> int:
    """``k = max(1, floor(ratio * numel))``, with ``ratio`` read as the decimal the user wrote
    (``0.29 * 100`` is 29, not the float product's 28.999...)."""
    return max(1, math.floor(Fraction(repr(float(ratio))) * numel))


class EntrySparsifier(Compressor):
    """A sparsifier whose payload is ``[values, flat indices]`` with a :class:`SparseContext`:
    decoding scatters the values into zeros, aggregating scatter-adds every rank's entries."""

    sends_entries = True

    def __init__(self) -> None:
        super().__init__()
        # Large dense outputs are kept per size (docs/DESIGN.md#kept-buffers).
        self._outputs = BufferPool(min_bytes=LARGE)

    def _zeros(self, purpose: str, ctx: SparseContext) -> torch.Tensor:
        return self._outputs.zeros((purpose, ctx.numel, ctx.dtype, ctx.device), ctx.numel, ctx.dtype, ctx.device)

    def decompress(self, payload: Payload, ctx: SparseContext) -> torch.Tensor:
        values, indices = payload
        return densify(values, indices, ctx, out=self._zeros("decompress", ctx))

    def support(self, payload: Payload, ctx: SparseContext) -> torch.Tensor:
        """The flat indices whose values ``payload`` carries (what DGC's factor masking zeroes)."""
        return payload[1].long()

    def aggregate(self, payloads: Sequence[Payload], ctx: SparseContext, average: bool) -> torch.Tensor:
        return scatter_sum(payloads, ctx, average, out=self._zeros("aggregate", ctx))

    def scatter_context(self, ctx: SparseContext) -> SparseContext:
        return ctx
