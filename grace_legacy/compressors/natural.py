"""Natural compression: stochastic rounding to a power of two (see :mod:`~grace_legacy.compressors.quantization`)."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.kernels import natural_passes
from grace_legacy.compressors.quantization import (
    ScaledContext,
    check_seed,
    draw_key,
    work_dtype,
)
from grace_legacy.core.compressor import Payload, Randomized
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.runtime.validation import check_gradient


class Natural(Randomized):
    """Natural compression (Horvath et al., 2019): each element rounded at random to one of the two
    powers of two around it. For ``2^a <= |x| < 2^(a+1)``, ``|x|`` becomes ``2^(a+1)`` with
    probability ``|x| / 2^a - 1``, else ``2^a``, keeping its sign: ``E[C(x)] = x`` and
    ``E[(C(x) - x)^2] <= x^2 / 8``. Zeros stay zero; subnormals follow the same rule.

    Payload ``[top, codes]``: ``top`` (int16) is ``a + 1`` of the largest finite nonzero ``|x|`` (0
    if none); one byte per element, bit 7 the sign and bits 0-6 a code ``c``: 0 is zero,
    ``1..127`` is ``2^(top - 127 + c)`` (the 127 binades ``2^(top - 126) .. 2^top``), and ``0x80``
    marks an inf or NaN, decoded as NaN. An element below that range becomes ``2^(top - 126)`` with
    probability ``|x| / 2^(top - 126)``, else 0 (still unbiased); one in its dtype's last binade
    (``|x| >= 2^15`` in float16, ``2^127`` in float32) may round up to inf. ``2 + n`` bytes rounded up
    to a multiple of 8. Any floating dtype; no parameter."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = check_seed(seed, "Natural")

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "Natural")
        work = work_dtype(tensor.dtype)
        x = tensor.detach().reshape(-1).to(work)
        top, codes = natural_passes.codes(x, draw_key(self, self.seed, name))
        return [top, codes], ScaledContext(tensor.shape, tensor.dtype, work)

    def decompress(self, payload: Payload, ctx: ScaledContext) -> torch.Tensor:
        top, codes = payload
        return natural_passes.decoded(top, codes, ctx.work, ctx.dtype).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, torch.int16), (numel, torch.uint8)]

    def __repr__(self) -> str:
        return f"Natural(seed={self.seed})"

    def recommended_memory(self) -> Memory:
        """``NoMemory``: the estimate is unbiased, so there is no systematic error to feed back."""
        return NoMemory()
