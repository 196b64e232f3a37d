"""1-bit SGD: one bit per entry for its side, and each side's mean (see :mod:`~grace_legacy.compressors.signs`)."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.kernels import sign_passes
from grace_legacy.compressors.kernels.bits import packed_length
from grace_legacy.compressors.signs import SignContext, choose, sign_context
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory
from grace_legacy.memories.residual import Residual


class OneBit(Compressor):
    """1-bit SGD (Seide et al., 2014; GRACE's ``onebit``), meant for error feedback (``Residual``):
    one bit per entry gives its side, two scalars each side's mean:

        mu_+ = mean{x_i : x_i >= 0},   mu_- = mean{x_i : x_i < 0}   (0 for an empty side)
        D(x)_i = mu_+ if x_i >= 0 else mu_-

    so ``sum_i D(x)_i == sum_i x_i`` up to rounding. Payload ``[bits, means]``: ``ceil(n / 8)``
    bytes and the means in the gradient's dtype (summed in fp32 for half precision). The aggregate
    is the mean of the decoded tensors (the sum with ``average=False``), not a vote."""

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = sign_context(tensor, "OneBit")
        packed, means = sign_passes.side_means(tensor.reshape(-1))
        return [packed, means], ctx

    def decompress(self, payload: Payload, ctx: SignContext) -> torch.Tensor:
        packed, means = payload
        return choose(packed, ctx, means[0], means[1])

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(packed_length(numel), torch.uint8), (2, dtype)]

    def recommended_memory(self) -> Memory:
        return Residual()
