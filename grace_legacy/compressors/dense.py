"""Compressors that keep every element: the dense reference and the two 16-bit floating types."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from grace_legacy.core.compressor import Elementwise, Payload
from grace_legacy.core.traits import Traits
from grace_legacy.runtime import paths
from grace_legacy.runtime.buffers import MMAP_CEILING, BufferPool
from grace_legacy.runtime.validation import check_gradient


class NoCompression(Elementwise):
    """Sends the gradient as it is, through a plain allreduce (the route of every uncompressed tensor)."""

    # A sum keeps every inf and NaN.
    traits = Traits(additive=True, lossless=True, delivers_nonfinite=True, elementwise=True)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "NoCompression")
        return [tensor], None

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        return payload[0]

    def decompress_flat(self, flat: torch.Tensor, contexts: Sequence[Any],
                        out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and out.dtype == flat.dtype and out.numel() == flat.numel():
            return out.copy_(flat)
        return flat

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, dtype)]


class _WireCast(Elementwise):
    """Casts to :attr:`wire_dtype` for the wire and back to the gradient's dtype on arrival. The
    payload is additive: every rank's cast is summed by one allreduce, in the wire dtype."""

    # The cast keeps inf and NaN (and makes inf of what overflows); a sum keeps them.
    traits = Traits(additive=True, delivers_nonfinite=True, elementwise=True)
    #: the 2-byte floating type the payload travels in
    wire_dtype: ClassVar[torch.dtype]

    def __init__(self) -> None:
        super().__init__()
        # Outputs above glibc's mmap ceiling are kept per size (docs/DESIGN.md#kept-buffers).
        self._outputs = BufferPool(min_bytes=MMAP_CEILING)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, type(self).__name__)
        return [_CAST_TO[self.wire_dtype](tensor)], tensor.dtype

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        wire = payload[0]
        if ctx == self.wire_dtype or wire.numel() * ctx.itemsize < self._outputs.min_bytes or not paths.cpu_path(wire):
            return _CAST_TO[ctx](wire)
        out = self._outputs.empty((wire.numel(), ctx), wire.numel(), ctx, wire.device)
        return out.view(wire.shape).copy_(wire)

    def decompress_flat(self, flat: torch.Tensor, contexts: Sequence[Any],
                        out: torch.Tensor | None = None) -> torch.Tensor | None:
        """One cast of the whole ``flat`` when every tensor has one dtype (into ``out`` when it has
        that dtype): elementwise, so each piece is that tensor's own cast."""
        dtypes = set(contexts)
        if len(dtypes) != 1:
            return None
        dtype = dtypes.pop()
        if out is not None and out.dtype == dtype and out.numel() == flat.numel():
            return out.copy_(flat)
        return self.decompress([flat], dtype)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(numel, self.wire_dtype)]


class FP16(_WireCast):
    """Casts to IEEE half precision for the wire (2 bytes per element, averaged by an allreduce in
    fp16) and back to the gradient's dtype (fp32, fp64, fp16 or bf16). Values beyond fp16's range
    (|x| > 65504) become inf, as with Horovod's ``Compression.fp16``, and values below about 3e-8
    become 0."""

    wire_dtype = torch.float16


class BF16(_WireCast):
    """Casts to bfloat16 for the wire and back to the gradient's dtype on arrival: PyTorch's
    ``bf16_compress_hook`` as a compressor.

    2 bytes per element, rounded to nearest even: 8 significant bits and fp32's 8 exponent bits,
    so every finite fp32 gradient stays finite and no normal fp32 value underflows to 0; the price
    is 3 fewer significant bits than :class:`FP16`. Averaged by an allreduce in bf16 (under
    Horovod, which has no bf16 type, by a gather summed in fp32 on every rank:
    :meth:`grace_legacy.backends.horovod.HorovodBackend.allreduce_async`). Works for fp32, fp64,
    fp16 and bf16 gradients; a bf16 gradient travels unchanged, an fp64 one beyond bf16's range
    (about 3.4e38) becomes inf."""

    wire_dtype = torch.bfloat16


# The casts by name: the cast is the whole work for a small tensor, and ``Tensor.to(dtype)``
# spends longer choosing among its overloads than these take to run.
_CAST_TO = {torch.float32: torch.Tensor.float, torch.float64: torch.Tensor.double,
            torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16}
