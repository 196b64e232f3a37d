"""Threshold sparsification: send every entry whose magnitude reaches a fixed threshold."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.entries import EntrySparsifier
from grace_legacy.compressors.kernels.selection import entries_at_or_above
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.core.compressor import Payload
from grace_legacy.core.memory import Memory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import check_gradient

THRESHOLD = ScheduledParameter("threshold", low=0.0, high=None, low_inclusive=False, high_inclusive=False, dense=None)


class Threshold(EntrySparsifier):
    """Sends the entries with ``|g_i| >= threshold`` (Strom 2015, without his 1-bit quantization),
    as ``[values, indices]``: signed values in the gradient's dtype, int32 indices in increasing
    order (int64 for tensors of 2**31 elements or more).

    Bytes: ``(element size + 4) * m`` where ``m = #{i : |g_i| >= threshold}`` (8 per kept entry for
    fp32) plus the gather's per-rank size header. ``m`` depends on the gradient's values, so it
    differs between ranks and steps and may be 0: ``uniform_payload`` is False, and an empty
    payload decompresses to zeros. The comparison is exact in every floating dtype (fp32, fp16,
    bf16, fp64; see :func:`~grace_legacy.compressors.kernels.selection.magnitude_bound`). NaN
    entries are never sent (``NaN >= t`` is false).

    Not additive (ranks keep different entries), so it is gathered. Pairs with ``Residual``: an
    entry below the threshold accumulates until it crosses it. ``payload_spec`` cannot predict the
    size, so budget matching refuses this compressor.
    """

    parameter = THRESHOLD
    uniform_payload = False

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
