"""QSGD's passes (:class:`~grace_legacy.QSGD`): the norm, the signed levels, and their decoding.

With ``r_i = min(|x_i| / norm * s, s)``, level ``l_i`` is ``floor(r_i) + [u_i < r_i - floor(r_i)]``
with the sign of ``x_i``, for the uniform draw ``u_i`` of element ``i``
(:mod:`~grace_legacy.compressors.kernels.draws`); a level decodes as ``norm * (l_i / s)``. Each
pass is written twice: the torch formula (``*_reference``, which every device other than the
CPU runs) and a loop compiled by numba with the same float operations in the same order, so the
two give the same bits; :func:`levels` and :func:`decoded` pick one (docs/DESIGN.md#compiled-passes).
The norm sums squares in float64 on both; the CPU's order is fixed (:func:`sum_of_squares`), a
device's is its own, so the two norms may differ in their last bit.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled
from grace_legacy.compressors.kernels.draws import draw_pair, key_word, uniform

BLOCK = compiled.BLOCK
#: Below this float64 norm, squares of elements under about 2**-537 (float64 gradients only) may
#: have underflowed enough to matter, so the norm is taken again from rescaled elements.
TINY_NORM = 2.0**-450


def norm(x: torch.Tensor) -> float:
    """The 2-norm of flat ``x`` (float32 or float64), squares summed in float64 (float32 squares
    overflow): on a CPU in :func:`sum_of_squares`' order, elsewhere ``torch.linalg.vector_norm``'s."""
    if compiled.applies(x):
        total = math.sqrt(sum_of_squares(x))
    else:
        total = torch.linalg.vector_norm(x, dtype=torch.float64).item()
    if total < TINY_NORM:  # rare: all-zero, or elements tiny enough that squares underflow
        largest = x.abs().amax()
        if bool(largest == 0):
            return 0.0
        # Scaled exactly, by powers of two, so that the largest magnitude is in [0.5, 1); in two
        # halves, since 2**1074 (for the least subnormal) is beyond float64.
        exponent = torch.frexp(largest).exponent.to(torch.float64)
        half = torch.floor(-exponent / 2)
        scaled = x.to(torch.float64) * torch.exp2(half) * torch.exp2(-exponent - half)
        total = (torch.linalg.vector_norm(scaled, dtype=torch.float64) * torch.exp2(exponent)).item()
    return total


def sum_of_squares(x: torch.Tensor) -> float:
    """The sum of the float64 squares of CPU tensor ``x``'s elements, in an order fixed by the
    element count alone: each block of :data:`BLOCK` elements sums into four partial sums, of the
    elements at positions 0, 1, 2, 3 modulo 4 (the block's last ``len % 4`` go to the first), added
    as ``(s0 + s1) + (s2 + s3)``; the blocks' sums are added in block order. The four sums let the
    loop vectorize."""
    return compiled.run(_sum_of_squares, _sum_of_squares_parallel, x.numel(), x.numpy())


@compiled.loop
def _squares_range(x, start, end):  # pragma: no cover - compiled
    x = x[start:end]
    s0 = s1 = s2 = s3 = 0.0
    end = x.size
    whole = end - end % 4
    for i in range(0, whole, 4):
        v0, v1, v2, v3 = np.float64(x[i]), np.float64(x[i + 1]), np.float64(x[i + 2]), np.float64(x[i + 3])
        s0 += v0 * v0
        s1 += v1 * v1
        s2 += v2 * v2
        s3 += v3 * v3
    for i in range(whole, end):
        v = np.float64(x[i])
        s0 += v * v
    return (s0 + s1) + (s2 + s3)


@compiled.loop
def _sum_of_squares(x):  # pragma: no cover - compiled
    total = 0.0
    for b in range((x.size + BLOCK - 1) // BLOCK):
        total += _squares_range(x, b * BLOCK, min(x.size, (b + 1) * BLOCK))
    return total


@compiled.parallel_loop
def _sum_of_squares_parallel(x):  # pragma: no cover - compiled
    count = (x.size + BLOCK - 1) // BLOCK
    partial = np.empty(count)
    for b in numba.prange(count):
        partial[b] = _squares_range(x, b * BLOCK, min(x.size, (b + 1) * BLOCK))
    total = 0.0
    for b in range(count):
        total += partial[b]
    return total


def levels_reference(x: torch.Tensor, norm: float, s: int, key: int) -> torch.Tensor:
    """The signed levels of flat ``x`` (float32 or float64) for a finite positive ``norm``, as
    floats of ``x``'s dtype, by tensor arithmetic on ``x``'s device."""
    # Divided first: an element equal to the norm (any 1-element tensor) gets exactly s.
    # In place from here on: each pass writes into a tensor this call made (fresh memory is costly).
    ratio = x.abs().div_(x.new_tensor(norm)).mul_(s)
    ratio.clamp_(0, s)  # only undoes a last-bit rounding of a float64 gradient's norm
    level = ratio.floor()
    # The draw becomes 1.0 where it falls below the fractional part: the chance of rounding up.
    level += uniform(key, x.numel(), x.dtype, x.device).lt_(ratio.sub_(level))
    # copysign, not where(x < 0, -l, l): the two differ only at l = 0 (-0.0), the same integer.
    return level.copysign_(x)


def levels(x: torch.Tensor, norm: float, s: int, key: int, dtype: torch.dtype) -> torch.Tensor:
    """QSGD's signed levels of flat ``x`` (float32 or float64) for a finite positive ``norm`` and
    ``s`` levels, with the draws of ``key``, as integers of ``dtype``: the compiled loop on a CPU,
    else :func:`levels_reference`."""
    if not compiled.applies(x):
        return levels_reference(x, norm, s, key).to(dtype)
    out = torch.empty(x.numel(), dtype=dtype)
    work = x.numpy().dtype.type
    compiled.run(_levels, _levels_parallel, x.numel(), x.numpy(), work(norm), work(s), key_word(key), out.numpy())
    return out


@compiled.inline
def _level(value, u, norm, s, one):  # pragma: no cover - compiled
    ratio = min(abs(value) / norm * s, s)
    level = np.floor(ratio)
    if u < ratio - level:
        level += one
    return np.int32(np.copysign(level, value))


# Elements go by pairs, the pair a float32 word draws for, then the last of an odd count: a bounds
# test inside the loop halves its speed. A range starts at an even element (blocks do).
@compiled.loop
def _levels_range(x, norm, s, key, out, start, end):  # pragma: no cover - compiled
    one = x.dtype.type(1)
    first = start // 2
    x, out, n = x[start:end], out[start:end], end - start
    for j in range(n // 2):
        u0, u1 = draw_pair(key, first + j, x)
        out[2 * j] = _level(x[2 * j], u0, norm, s, one)
        out[2 * j + 1] = _level(x[2 * j + 1], u1, norm, s, one)
    if n % 2:
        out[n - 1] = _level(x[n - 1], draw_pair(key, first + n // 2, x)[0], norm, s, one)


@compiled.loop
def _levels(x, norm, s, key, out):  # pragma: no cover - compiled
    _levels_range(x, norm, s, key, out, 0, x.size)


@compiled.parallel_loop
def _levels_parallel(x, norm, s, key, out):  # pragma: no cover - compiled
    for b in numba.prange((x.size + BLOCK - 1) // BLOCK):
        _levels_range(x, norm, s, key, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))


def decoded_reference(codes: torch.Tensor, scale: torch.Tensor, divisor: int, work: torch.dtype) -> torch.Tensor:
    """``scale * (codes / divisor)`` in ``work`` (float32 or float64), by tensor arithmetic:
    dividing first, the extreme levels ``+-divisor`` give the scale itself, with no rounding."""
    return scale.to(work) * (codes.to(work) / divisor)


def decoded(codes: torch.Tensor, scale: torch.Tensor, divisor: int, work: torch.dtype) -> torch.Tensor:
    """``scale * (codes / divisor)`` for every integer code, in ``work``: the decoding of QSGD's
    levels (``divisor``: the levels) and TernGrad's digits (``divisor`` 1). The compiled loop on a
    CPU, else :func:`decoded_reference`; ``scale`` is a 1-element tensor."""
    if not compiled.applies(codes):
        return decoded_reference(codes, scale, divisor, work)
    out = torch.empty(codes.shape, dtype=work)
    dtype = out.numpy().dtype.type
    compiled.run(_scaled, _scaled_parallel, codes.numel(), codes.numpy(), dtype(float(scale)), dtype(divisor),
                 out.numpy())
    return out


@compiled.loop
def _scaled_range(codes, scale, divisor, out, start, end):  # pragma: no cover - compiled
    codes, out = codes[start:end], out[start:end]
    for i in range(out.size):
        out[i] = scale * (out.dtype.type(codes[i]) / divisor)


@compiled.loop
def _scaled(codes, scale, divisor, out):  # pragma: no cover - compiled
    _scaled_range(codes, scale, divisor, out, 0, codes.size)


@compiled.parallel_loop
def _scaled_parallel(codes, scale, divisor, out):  # pragma: no cover - compiled
    for b in numba.prange((codes.size + BLOCK - 1) // BLOCK):
        _scaled_range(codes, scale, divisor, out, b * BLOCK, min(codes.size, (b + 1) * BLOCK))
