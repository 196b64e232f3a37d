"""TernGrad's passes (:class:`~grace_legacy.TernGrad`): the spread that sets the clipping bound,
and the ternary digits.

Digit ``t_i`` of ``x_i`` clipped to ``[-bound, bound]`` is ``sign(x_i)`` where the uniform draw
``u_i`` of element ``i`` (:mod:`~grace_legacy.compressors.kernels.draws`) falls below
``|clip(x_i)| / scale``, else 0; digits decode as QSGD's levels with one level
(:func:`~grace_legacy.compressors.kernels.qsgd_passes.decoded`). The digits are written twice: the
torch formula (:func:`digits_reference`, which every device other than the CPU runs) and a loop
compiled by numba with the same float operations in the same order, so the two give the same
bits; :func:`digits` picks one (docs/DESIGN.md#compiled-passes). The spread is a float64 standard
deviation on both, summed in a fixed order on a CPU and in torch's elsewhere, so the two may
differ in their last bit.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled
from grace_legacy.compressors.kernels.draws import draw_pair, key_word, uniform

BLOCK = compiled.BLOCK


def spread(x: torch.Tensor) -> tuple[float, float, float]:
    """``(sigma, lowest, highest)`` of flat ``x`` (float32 or float64): the standard deviation
    (dividing by n, in float64) and the extremes; all NaN if an element is NaN (sigma also if one
    is infinite). On a CPU two compiled float64 passes, each summed by blocks of :data:`BLOCK` as
    :func:`~grace_legacy.compressors.kernels.qsgd_passes.sum_of_squares` is: the mean (with the
    extremes), then the squared deviations from it; elsewhere ``torch.std`` and ``torch.aminmax``."""
    if not compiled.applies(x):
        lowest, highest = torch.aminmax(x)
        wide = x.to(torch.float64)
        return tuple(torch.stack([torch.std(wide, correction=0), lowest.to(wide.dtype),
                                  highest.to(wide.dtype)]).tolist())
    sigma, lowest, highest, not_finite = compiled.run(_spread, _spread_parallel, x.numel(), x.numpy())
    if not_finite and bool(torch.isnan(x).any()):  # the extremes skip NaN
        return math.nan, math.nan, math.nan
    return sigma, lowest, highest


@compiled.loop
def _sum_and_extremes_range(x, start, end):  # pragma: no cover - compiled
    x = x[start:end]
    end = x.size
    whole = end - end % 4
    s0 = s1 = s2 = s3 = 0.0
    lowest = highest = np.float64(x[0])
    for i in range(0, whole, 4):
        v0, v1, v2, v3 = np.float64(x[i]), np.float64(x[i + 1]), np.float64(x[i + 2]), np.float64(x[i + 3])
        s0 += v0
        s1 += v1
        s2 += v2
        s3 += v3
        # Comparisons, not min and max: numba's float min and max test for NaN at every call.
        for v in (v0, v1, v2, v3):
            if v < lowest:
                lowest = v
            if v > highest:
                highest = v
    for i in range(whole, end):
        v = np.float64(x[i])
        s0 += v
        if v < lowest:
            lowest = v
        if v > highest:
            highest = v
    return (s0 + s1) + (s2 + s3), lowest, highest


@compiled.loop
def _deviations_range(x, mean, start, end):  # pragma: no cover - compiled
    x = x[start:end]
    end = x.size
    whole = end - end % 4
    s0 = s1 = s2 = s3 = 0.0
    for i in range(0, whole, 4):
        d0, d1 = np.float64(x[i]) - mean, np.float64(x[i + 1]) - mean
        d2, d3 = np.float64(x[i + 2]) - mean, np.float64(x[i + 3]) - mean
        s0 += d0 * d0
        s1 += d1 * d1
        s2 += d2 * d2
        s3 += d3 * d3
    for i in range(whole, end):
        d = np.float64(x[i]) - mean
        s0 += d * d
    return (s0 + s1) + (s2 + s3)


@compiled.loop
def _spread(x):  # pragma: no cover - compiled
    n = x.size
    total = 0.0
    lowest = highest = np.float64(x[0])
    for b in range((n + BLOCK - 1) // BLOCK):
        s, low, high = _sum_and_extremes_range(x, b * BLOCK, min(n, (b + 1) * BLOCK))
        total += s
        if low < lowest:
            lowest = low
        if high > highest:
            highest = high
    mean = total / n
    deviations = 0.0
    for b in range((n + BLOCK - 1) // BLOCK):
        deviations += _deviations_range(x, mean, b * BLOCK, min(n, (b + 1) * BLOCK))
    variance = deviations / n
    return np.sqrt(variance), lowest, highest, variance != variance


@compiled.parallel_loop
def _spread_parallel(x):  # pragma: no cover - compiled
    n = x.size
    count = (n + BLOCK - 1) // BLOCK
    sums, lows, highs = np.empty(count), np.empty(count), np.empty(count)
    for b in numba.prange(count):
        sums[b], lows[b], highs[b] = _sum_and_extremes_range(x, b * BLOCK, min(n, (b + 1) * BLOCK))
    total = 0.0
    lowest = highest = np.float64(x[0])
    for b in range(count):
        total += sums[b]
        if lows[b] < lowest:
            lowest = lows[b]
        if highs[b] > highest:
            highest = highs[b]
    mean = total / n
    for b in numba.prange(count):
        sums[b] = _deviations_range(x, mean, b * BLOCK, min(n, (b + 1) * BLOCK))
    deviations = 0.0
    for b in range(count):
        deviations += sums[b]
    variance = deviations / n
    return np.sqrt(variance), lowest, highest, variance != variance


def digits_reference(x: torch.Tensor, bound: float, scale: float, key: int) -> torch.Tensor:
    """The ternary digits of flat ``x`` (float32 or float64, every element finite) clipped to
    ``[-bound, bound]``, for a finite positive ``scale``, as floats of ``x``'s dtype, by tensor
    arithmetic on ``x``'s device."""
    clipped = torch.clamp(x, min=-bound, max=bound)
    dropped = uniform(key, x.numel(), x.dtype, x.device) >= clipped.abs().div_(x.new_tensor(scale))
    return clipped.sign_().masked_fill_(dropped, 0.0)


def digits(x: torch.Tensor, bound: float, scale: float, key: int) -> torch.Tensor:
    """TernGrad's digits of flat ``x`` as int8 (see :func:`digits_reference`): the compiled loop on
    a CPU, else the reference."""
    if not compiled.applies(x):
        return digits_reference(x, bound, scale, key).to(torch.int8)
    out = torch.empty(x.numel(), dtype=torch.int8)
    work = x.numpy().dtype.type
    compiled.run(_digits, _digits_parallel, x.numel(), x.numpy(), work(bound), work(scale), key_word(key),
                 out.numpy())
    return out


@compiled.inline
def _digit(value, u, bound, scale):  # pragma: no cover - compiled
    # Comparisons, not min and max (see _sum_and_extremes_range): every value is finite here.
    clipped = value
    if clipped < -bound:
        clipped = -bound
    if clipped > bound:
        clipped = bound
    kept = np.int32(u < abs(clipped) / scale)
    return kept * (np.int32(clipped > 0) - np.int32(clipped < 0))


# By pairs of elements, as QSGD's levels (qsgd_passes: why).
@compiled.loop
def _digits_range(x, bound, scale, key, out, start, end):  # pragma: no cover - compiled
    first = start // 2
    x, out, n = x[start:end], out[start:end], end - start
    for j in range(n // 2):
        u0, u1 = draw_pair(key, first + j, x)
        out[2 * j] = _digit(x[2 * j], u0, bound, scale)
        out[2 * j + 1] = _digit(x[2 * j + 1], u1, bound, scale)
    if n % 2:
        out[n - 1] = _digit(x[n - 1], draw_pair(key, first + n // 2, x)[0], bound, scale)


@compiled.loop
def _digits(x, bound, scale, key, out):  # pragma: no cover - compiled
    _digits_range(x, bound, scale, key, out, 0, x.size)


@compiled.parallel_loop
def _digits_parallel(x, bound, scale, key, out):  # pragma: no cover - compiled
    for b in numba.prange((x.size + BLOCK - 1) // BLOCK):
        _digits_range(x, bound, scale, key, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))
