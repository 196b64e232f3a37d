"""EF-signSGD: the scaled sign of the error-compensated step (see :mod:`~grace_legacy.compressors.signs`)."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.kernels import sign_passes
from grace_legacy.compressors.kernels.bits import packed_length
from grace_legacy.compressors.signs import SignContext, choose, sign_context
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory
from grace_legacy.memories.efsignsgd import EFSignSGDMemory, check_learning_rate


class EFSignSGD(Compressor):
    """EF-signSGD (Karimireddy et al., 2019; GRACE's ``efsignsgd``). Its memory (only, and by default,
    :class:`~grace_legacy.memories.EFSignSGDMemory` with the same ``lr``) hands over ``p = lr g + e``;
    this sends

        C(p) = (||p||_1 / n) * sign(p)

    as ``[bits, scale]``: ``ceil(n / 8)`` bytes and one scale in the gradient's dtype (computed in
    fp32 for half precision). The aggregate is the mean over ranks of ``scale_r * sign_r`` (the sum
    with ``average=False``), gathered; the memory divides it by ``lr`` and keeps ``e <- p - C(p)``,
    so the optimizer's step is exactly the mean of the ranks' EF-signSGD steps."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = check_learning_rate(lr, "EFSignSGD")

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = sign_context(tensor, "EFSignSGD")
        packed, scale = sign_passes.mean_magnitude(tensor.reshape(-1))
        return [packed, scale], ctx

    def decompress(self, payload: Payload, ctx: SignContext) -> torch.Tensor:
        packed, scale = payload
        return choose(packed, ctx, scale[0], -scale[0])

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(packed_length(numel), torch.uint8), (1, dtype)]

    def recommended_memory(self) -> Memory:
        return EFSignSGDMemory(self.lr)

    def check_memory(self, memory: Memory) -> None:
        if not isinstance(memory, EFSignSGDMemory):
            raise ValueError(
                f"{self!r} needs EFSignSGDMemory(lr={self.lr!r}), got {memory!r}: its error feedback works "
                f"in units of lr * gradient and its aggregate is divided back by lr; leave memory=None")
        if memory.lr != self.lr:
            raise ValueError(f"{self!r} needs EFSignSGDMemory(lr={self.lr!r}) with the same learning rate, "
                             f"got {memory!r}")

    def __repr__(self) -> str:
        return f"EFSignSGD(lr={self.lr!r})"
