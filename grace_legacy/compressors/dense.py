"""Compressors that keep every element: the dense reference and the two 16-bit floating types."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

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


class _WireCast(Compressor):
    """Casts to :attr:`wire_dtype` for the wire and back to the gradient's dtype on arrival. The
    payload is additive: every rank's cast is summed by one allreduce, in the wire dtype."""

    additive = True
    #: the 2-byte floating type the payload travels in
    wire_dtype: ClassVar[torch.dtype]

    def __init__(self) -> None:
        super().__init__()
        # Outputs above glibc's largest mmap threshold, one per size, used again once the caller
        # has let go of them (grace_legacy.core.recycle): each fresh one is a new mapping whose
        # pages fault at every step. Smaller ones come warm from the heap, and a kept one, cold,
        # would cost more than it saves.
        self._outputs = Recycler(min_bytes=MMAP_CEILING)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, type(self).__name__)
        return [_CAST_TO[self.wire_dtype](tensor)], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        wire = payload[0]
        if ctx == self.wire_dtype or wire.numel() * ctx.itemsize < self._outputs.min_bytes or wire.device.type != "cpu":
            return _CAST_TO[ctx](wire)
        out = self._outputs.empty((wire.numel(), ctx), wire.numel(), ctx, wire.device)
        return out.view(wire.shape).copy_(wire)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, self.wire_dtype)]


class FP16(_WireCast):
    """Casts to IEEE half precision for the wire and back to the gradient's dtype on arrival.

    2 bytes per element: 11 significant bits and 5 exponent bits. Values beyond fp16's range
    (|x| > 65504) become inf, as with Horovod's own ``Compression.fp16``, and values too small for
    it (below about 3e-8) become 0; the payload is additive and is averaged by an allreduce in fp16. Works
    for fp32, fp64, fp16 and bf16 gradients (a bf16 value beyond fp16's range becomes inf).
    """

    wire_dtype = torch.float16


class BF16(_WireCast):
    """Casts to bfloat16 for the wire and back to the gradient's dtype on arrival: PyTorch's
    ``bf16_compress_hook`` as a compressor.

    2 bytes per element, rounded to nearest even: 8 significant bits and fp32's 8 exponent bits,
    so unlike :class:`FP16` every finite fp32 gradient stays finite and none underflows to 0 that
    fp32 keeps; the price is 3 fewer significant bits. The payload is additive and is averaged by
    an allreduce in bf16 (under Horovod, which cannot reduce bf16, by a gather summed in fp32 on
    every rank: :meth:`grace_legacy.backends.horovod.HorovodBackend.allreduce_async`). Works for
    fp32, fp64, fp16 and bf16 gradients; a bf16 gradient travels unchanged, and an fp64 one beyond
    bf16's range (about 3.4e38) becomes inf.
    """

    wire_dtype = torch.bfloat16


# The casts by name: the cast is the whole work for a small tensor, and ``Tensor.to(dtype)``
# spends longer choosing among its overloads than these take to run.
_CAST_TO = {torch.float32: torch.Tensor.float, torch.float64: torch.Tensor.double,
            torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16}
