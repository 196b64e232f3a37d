"""Independent references for compressors (BF16): each written from its documented definition,
sharing no code with ``grace_legacy``'s version, and producing the same payload layout, so that a
test can hold the library to it bit for bit: the payloads, and every decoded value.

They subclass ``grace_legacy.Compressor`` only to serve as the twins of the registry's reference
cases (``tests/registry.py``): the bundle calls ``resolve``, ``compress``, ``decompress`` and reads the
class flags; everything they compute is their own.
"""

from __future__ import annotations

import torch

from grace_legacy import Compressor


class _Reference(Compressor):
    """Per-tensor step counters of the references' own."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: dict[str, int] = {}

    def count(self, name: str) -> int:
        step = self.counted.get(name, 0)
        self.counted[name] = step + 1
        return step


class BF16Reference(_Reference):
    """A cast to bfloat16 (round to nearest even), summed by an allreduce, cast back."""

    additive = True

    def compress(self, tensor, name):
        return [tensor.detach().clone().to(torch.bfloat16)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        return payload[0].to(dtype).reshape(shape)

    def payload_spec(self, numel, dtype):
        return [(numel, torch.bfloat16)]
