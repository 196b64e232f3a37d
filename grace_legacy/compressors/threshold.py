"""Threshold sparsification: send every entry whose magnitude reaches a fixed threshold."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.entries import EntrySparsifier
from grace_legacy.compressors.kernels.threshold_passes import entries_at_or_above
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.core.compressor import Payload, Tunable
from grace_legacy.core.memory import Memory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import check_gradient

THRESHOLD = ScheduledParameter("threshold", low=0.0, high=None, low_inclusive=False, high_inclusive=False, dense=None)


class Threshold(EntrySparsifier, Tunable):
    """Sends the entries with ``|g_i| >= threshold`` (Strom 2015, without his 1-bit quantization),
    exactly in every floating dtype, NaN never: ``[values, indices]``, signed values in the
    gradient's dtype and int32 indices in increasing order (int64 from 2**31 elements).

    ``(element size + 4) * m`` bytes for ``m`` kept entries plus a size header: ``m`` depends on
    the values, may be 0 (decoding to zeros) and differs between ranks, so the payload is gathered
    with a header and its size cannot be predicted (budget matching, L-GreCo and the dense fallback
    leave it out). Pairs with ``Residual``: an entry accumulates until it crosses the threshold."""

    parameter = THRESHOLD
    traits = Traits(sends_entries=True, uniform_payload=False)

    def __init__(self, threshold: float | None = None) -> None:
        super().__init__()
        self._set_value(threshold)

    @property
    def threshold(self) -> float | None:
        return self.value

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "Threshold")
        self.check_ready()
        flat = tensor.reshape(-1)
        values, indices = entries_at_or_above(flat, self.threshold, index_dtype(flat.numel()))
        ctx = SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        return [values, indices], ctx

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        raise NotImplementedError(
            "Threshold sends every entry with |g| >= threshold, so its payload size depends on the "
            "gradient's values, not only on the tensor's size: it cannot be predicted for budget matching. "
            "Use a compressor with a fixed size (TopK, DGC) for Legacy.budget_matched.")

    def recommended_memory(self) -> Memory:
        return Residual()
