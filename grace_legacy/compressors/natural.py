"""Natural compression: stochastic rounding to a power of two (see :mod:`~grace_legacy.compressors.quantization`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from grace_legacy.compressors.kernels import stochastic
from grace_legacy.compressors.kernels.draws import uniform
from grace_legacy.compressors.quantization import (
    ScaledContext,
    check_seed,
    draw_key,
    work_dtype,
)
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.runtime.validation import check_gradient

#: Exponents a code byte covers below the tensor's top exponent.
NATURAL_SPAN = 127


#: The code byte of an element that was inf or NaN.
NON_FINITE_CODE = 0x80


# Per float dtype: the integer dtype of its bits, mantissa bits, exponent bias, least exponent.
_LAYOUT = {torch.float32: (torch.int32, 23, 127, -149), torch.float64: (torch.int64, 52, 1023, -1074)}


def pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2 ** exponent`` exactly (``torch.pow`` may miss by an ulp), as float32 or float64 built from
    its bits: subnormal where the dtype has them, 0 below, inf above."""
    int_dtype, mantissa_bits, bias, least = _LAYOUT[dtype]
    k = exponent.to(int_dtype)
    one = torch.ones_like(k)
    normal = torch.bitwise_left_shift(k.clamp(1 - bias, bias) + bias, mantissa_bits)
    subnormal = torch.bitwise_left_shift(one, (k - least).clamp(0, mantissa_bits - 1))
    infinity = (2 * bias + 1) << mantissa_bits
    bits = torch.where(k > bias, infinity,
                       torch.where(k >= 1 - bias, normal, torch.where(k >= least, subnormal, 0)))
    return bits.view(dtype)


class Natural(Compressor):
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
        key = draw_key(self, self.seed, name)
        ctx = ScaledContext(tensor.shape, tensor.dtype, work)
        if stochastic.kernels_apply(x):
            largest = stochastic.largest_finite_magnitude(x)
            # frexp's exponent grows with the magnitude: the largest's is every element's top.
            top = math.frexp(largest)[1] if largest > 0 else 0
            code = torch.empty(x.numel(), dtype=torch.uint8)
            stochastic.natural_codes(x, top - (NATURAL_SPAN - 1), key, code)
            return [torch.tensor([top], dtype=torch.int16), code], ctx
        # In place wherever the tensor is this call's own: every fresh full-size tensor costs.
        magnitude = x.abs()
        finite = torch.isfinite(x)
        absent = (magnitude > 0).logical_and_(finite).logical_not_()
        # |x| = m * 2^e with m in [0.5, 1): a = e - 1, and the chance of rounding up, |x| / 2^a - 1,
        # is 2m - 1, exact.
        mantissa, exponent = torch.frexp(magnitude.masked_fill_(~finite, 0.0))
        a = exponent - 1
        lowest = torch.iinfo(a.dtype).min
        top = torch.where(absent.all(), 0, a.masked_fill(absent, lowest).amax() + 1)
        bottom = top - (NATURAL_SPAN - 1)
        draw = uniform(key, x.numel(), work, x.device)

        # The code in range is a + (rounded up) - bottom + 1 (1..127: 2^(bottom - 1 + code)).
        code = (draw < 2 * mantissa - 1).to(a.dtype).add_(a).sub_(bottom - 1)
        below = a < bottom
        if bool(below.any()):  # elements some 2^126 under the largest: rare, so only then
            # Below the range the two neighbours are 0 and 2^bottom; e - bottom <= 0, so no overflow.
            below_code = (draw < mantissa * pow2(exponent - bottom, work)).to(a.dtype)
            code = torch.where(below, below_code, code)
        code.masked_fill_(absent, 0)
        # The sign bit only on nonzero codes (<= 127, so | 0x80 is + 0x80): 0x80 is kept for inf and NaN.
        code.add_((x < 0).logical_and_(code > 0), alpha=0x80)
        code.masked_fill_(~finite, NON_FINITE_CODE)
        return [top.to(torch.int16).reshape(1), code.to(torch.uint8)], ctx

    def decompress(self, payload: Payload, ctx: ScaledContext) -> torch.Tensor:
        top, codes = payload
        # A code byte has 256 values: decode those once, then look every element up (one gather
        # instead of a dozen elementwise passes).
        every_code = torch.arange(256, dtype=torch.int32, device=codes.device)
        magnitude_code = every_code & 0x7F
        table = pow2(top.to(torch.int32) - NATURAL_SPAN + magnitude_code, ctx.work)
        table = torch.where(every_code >= 0x80, -table, table)
        table = torch.where(magnitude_code == 0, 0.0, table)
        table = torch.where(every_code == NON_FINITE_CODE, float("nan"), table)
        if stochastic.kernels_apply(codes):
            return stochastic.look_up(codes, table).to(ctx.dtype).view(ctx.shape)
        return table.to(ctx.dtype).index_select(0, codes.to(torch.int32)).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, torch.int16), (numel, torch.uint8)]

    def __repr__(self) -> str:
        return f"Natural(seed={self.seed})"

    def recommended_memory(self) -> Memory:
        """``NoMemory``: the estimate is unbiased, so there is no systematic error to feed back."""
        return NoMemory()
