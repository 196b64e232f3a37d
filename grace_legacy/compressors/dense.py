"""Compressors that keep every element: the dense reference and half precision."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core import paths
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.recycle import MMAP_CEILING, Recycler
from grace_legacy.core.validation import check_gradient


class NoCompression(Compressor):
    """Sends the gradient as it is. Its payload is additive, so it goes through a plain allreduce:
    this is also the route any compressor takes for a tensor it leaves uncompressed."""

    additive = True
    lossless = True

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "NoCompression")
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, dtype)]


class FP16(Compressor):
    """Casts to IEEE half precision for the wire and back to the gradient's dtype on arrival.

    2 bytes per element. Values beyond fp16's range (|x| > 65504) become inf, as with Horovod's
    own ``Compression.fp16``; the payload is additive and is averaged by an allreduce in fp16.
    Works for fp32, fp64, fp16 and bf16 gradients.
    """

    additive = True

    def __init__(self) -> None:
        super().__init__()
        # Outputs above glibc's largest mmap threshold, one per size, used again once the caller
        # has let go of them (grace_legacy.core.recycle): each fresh one is a new mapping whose
        # pages fault at every step. Smaller ones come warm from the heap, and a kept one, cold,
        # would cost more than it saves.
        self._outputs = Recycler(min_bytes=MMAP_CEILING)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "FP16")
        return [tensor.half()], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        half = payload[0]
        if ctx == torch.float16 or half.numel() * ctx.itemsize < self._outputs.min_bytes or not paths.cpu_path(half):
            return _CAST_TO[ctx](half)
        out = self._outputs.empty((half.numel(), ctx), half.numel(), ctx, half.device)
        return out.view(half.shape).copy_(half)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, torch.float16)]


# The casts by name: the cast is the whole work for a small tensor, and ``Tensor.to(dtype)``
# spends longer choosing among its overloads than these take to run.
_CAST_TO = {torch.float32: torch.Tensor.float, torch.float64: torch.Tensor.double,
            torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16}
