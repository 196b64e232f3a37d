"""Compressors that keep every element: the dense reference and half precision."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.runtime.buffers import MMAP_CEILING, BufferPool
from grace_legacy.runtime.validation import check_gradient


class NoCompression(Compressor):
    """Sends the gradient as it is, through a plain allreduce (the route of every uncompressed tensor)."""

    additive = True
    lossless = True
    delivers_nonfinite = True  # a sum keeps every inf and NaN

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "NoCompression")
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, dtype)]


class FP16(Compressor):
    """Casts to IEEE half precision for the wire (2 bytes per element, averaged by an allreduce in
    fp16) and back to the gradient's dtype (fp32, fp64, fp16 or bf16). Values beyond fp16's range
    (|x| > 65504) become inf, as with Horovod's ``Compression.fp16``."""

    additive = True
    delivers_nonfinite = True  # half() keeps inf and NaN (and makes inf of what overflows); a sum keeps them

    def __init__(self) -> None:
        super().__init__()
        # Outputs above glibc's mmap ceiling are kept per size (docs/DESIGN.md#kept-buffers).
        self._outputs = BufferPool(min_bytes=MMAP_CEILING)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "FP16")
        return [tensor.half()], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        half = payload[0]
        if ctx == torch.float16 or half.numel() * ctx.itemsize < self._outputs.min_bytes or half.device.type != "cpu":
            return _CAST_TO[ctx](half)
        out = self._outputs.empty((half.numel(), ctx), half.numel(), ctx, half.device)
        return out.view(half.shape).copy_(half)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, torch.float16)]


# The casts by name: the cast is the whole work for a small tensor, and ``Tensor.to(dtype)``
# spends longer choosing among its overloads than these take to run.
_CAST_TO = {torch.float32: torch.Tensor.float, torch.float64: torch.Tensor.double,
            torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16}
