"""Compressors that keep every element: the dense reference and half precision."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
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

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "FP16")
        return [tensor.to(torch.float16)], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0].to(ctx)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, torch.float16)]
