"""Top-k: keep the entries of largest magnitude."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.entries import DENSITY, EntrySparsifier, kept_count
from grace_legacy.compressors.kernels.selection import top_k_indices
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.core.compressor import Payload, Tunable
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import check_gradient


class TopK(EntrySparsifier, Tunable):
    """Keeps the ``k = max(1, floor(ratio * n))`` entries of largest magnitude: the set
    ``torch.topk(x.abs(), k)`` picks (ties aside; NaN, then infinity first), found by
    :func:`~grace_legacy.compressors.kernels.selection.top_k_indices`.

    Payload ``[values, indices]``: signed values in the gradient's dtype, int32 indices (int64 from
    2**31 elements): ``8k`` bytes for fp32, gathered (ranks pick different indices). Any floating
    dtype; pairs with ``Residual``."""

    parameter = DENSITY
    # NaN and infinity are the largest magnitudes: always kept.
    traits = Traits(sends_entries=True, delivers_nonfinite=True)

    def __init__(self, ratio: float | None = None) -> None:
        super().__init__()
        self._set_value(ratio)

    @property
    def ratio(self) -> float | None:
        return self.value

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
        return Residual()
