"""Compiled CPU passes of the 1-bit compressors (docs/DESIGN.md#compiled-passes): one loop packs
each element's bit as :mod:`~grace_legacy.compressors.kernels.bits` lays them out and, when asked,
adds it to its side's sum; one loop decodes the bits straight into the values. Float32 and float64
CPU tensors only. Sums are kept in float64: each byte's eight elements on their own, then the bytes
in order.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled as _compiled
from grace_legacy.compressors.kernels.bits import packed_length

COMPILED_DTYPES = (torch.float32, torch.float64)


def kernels_apply(tensor: torch.Tensor) -> bool:
    """Whether the compiled loops handle ``tensor``: float32 or float64 on a CPU, while ``compiled.ENABLED``."""
    return _compiled.applies(tensor, COMPILED_DTYPES)


@functools.cache
def _kernels():
    compiled = _compiled.loop()

    @compiled
    def pack(x, out):  # pragma: no cover - compiled
        n = x.size
        for b in range(n // 8):
            byte = 0
            for k in range(8):
                byte |= (1 if x[8 * b + k] >= 0 else 0) << k
            out[b] = byte
        if n % 8:
            byte = 0
            for i in range(n - n % 8, n):
                byte |= (1 if x[i] >= 0 else 0) << (i % 8)
            out[n // 8] = byte

    @compiled
    def pack_and_sum_sides(x, out, exact):  # pragma: no cover - compiled
        # Each byte's eight elements are summed on their own, then the bytes in order. Without
        # `exact` the sides come from value +- |value| (twice the value on its side, 0 on the
        # other, both exact), with no select, which numba compiles to a slow branch; that holds
        # for finite sums only, so a non-finite result is retaken with `exact`, which selects.
        n = x.size
        up_total = down_total = 0.0
        count = 0
        for b in range((n + 7) // 8):
            byte = 0
            up = down = 0.0
            for i in range(8 * b, min(8 * b + 8, n)):
                value = np.float64(x[i])
                nonnegative = value >= 0  # NaN is negative, as in pack
                byte |= (1 if nonnegative else 0) << (i % 8)
                count += nonnegative
                if exact:
                    up += value if nonnegative else 0.0
                    down += 0.0 if nonnegative else value
                else:
                    up += value + abs(value)
                    down += value - abs(value)
            out[b] = byte
            up_total += up
            down_total += down
        if exact:
            return up_total, down_total, count
        return 0.5 * up_total, 0.5 * down_total, count

    @compiled
    def momentum_step(previous, gradient, keep, take, out, packed):  # pragma: no cover - compiled
        # out = previous * keep + gradient * take in out's dtype, as the tensor expression rounds
        # it (each product, then the sum; no fused multiply-add), and its signs packed.
        # Whole bytes first, with a fixed inner trip count (as in `pack`), which numba unrolls;
        # a bound that depends on n in the inner loop kept it a slow scalar loop.
        n = out.size
        for b in range(n // 8):
            byte = 0
            for k in range(8):
                value = previous[8 * b + k] * keep + out.dtype.type(gradient[8 * b + k]) * take
                out[8 * b + k] = value
                byte |= (1 if value >= 0 else 0) << k
            packed[b] = byte
        if n % 8:
            byte = 0
            for i in range(n - n % 8, n):
                value = previous[i] * keep + out.dtype.type(gradient[i]) * take
                out[i] = value
                byte |= (1 if value >= 0 else 0) << (i % 8)
            packed[n // 8] = byte

    @compiled
    def choose(packed, if_set, if_clear, out):  # pragma: no cover - compiled
        n = out.size
        for b in range(n // 8):
            byte = packed[b]
            for k in range(8):
                out[8 * b + k] = if_set if (byte >> k) & 1 else if_clear
        for i in range(n - n % 8, n):
            out[i] = if_set if (packed[i // 8] >> (i % 8)) & 1 else if_clear

    return pack, pack_and_sum_sides, choose, momentum_step


def pack_nonnegative(x: torch.Tensor) -> torch.Tensor:
    """The packed bits of ``x >= 0`` (flat), as :func:`~grace_legacy.compressors.kernels.bits.pack_bits`
    would give them."""
    out = torch.empty(packed_length(x.numel()), dtype=torch.uint8)
    _kernels()[0](x.reshape(-1).numpy(), out.numpy())
    return out


def pack_and_sum_sides(x: torch.Tensor) -> tuple[torch.Tensor, float, float, int]:
    """``(bits, nonnegative_sum, negative_sum, nonnegative_count)`` of ``x`` (flat): the packed
    bits of ``x >= 0``, the float64 sums of the elements on each side (NaN counts as negative),
    and how many are non-negative."""
    out = torch.empty(packed_length(x.numel()), dtype=torch.uint8)
    array = x.reshape(-1).numpy()
    up, down, count = _kernels()[1](array, out.numpy(), False)
    if not (math.isfinite(up) and math.isfinite(down)):  # inf or NaN in x, or an overflow
        up, down, count = _kernels()[1](array, out.numpy(), True)
    return out, up, down, count


def choose(packed: torch.Tensor, numel: int, if_set: float, if_clear: float, dtype: torch.dtype) -> torch.Tensor:
    """A flat ``dtype`` (float32 or float64) tensor of ``numel`` elements: ``if_set`` where the
    packed bit is 1, ``if_clear`` where it is 0 (both already values of ``dtype``)."""
    out = torch.empty(numel, dtype=dtype)
    array = out.numpy()
    _kernels()[2](packed.numpy(), array.dtype.type(if_set), array.dtype.type(if_clear), array)
    return out


def momentum_step(previous: torch.Tensor, gradient: torch.Tensor, momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, bits)``: the new momentum ``previous * momentum + gradient * (1 - momentum)``
    (a fresh tensor in ``previous``'s dtype and shape, rounded as that tensor expression is) and
    the packed bits of ``buffer >= 0``."""
    buffer = torch.empty_like(previous)
    packed = torch.empty(packed_length(buffer.numel()), dtype=torch.uint8)
    work = buffer.numpy().dtype.type
    _kernels()[3](previous.reshape(-1).numpy(), gradient.reshape(-1).numpy(), work(momentum), work(1.0 - momentum),
                  buffer.reshape(-1).numpy(), packed.numpy())
    return buffer, packed
