"""Natural compression's passes (:class:`~grace_legacy.Natural`): the code bytes and their decoding.

For ``|x| = m 2^e`` with ``m`` in ``[0.5, 1)``, ``a = e - 1``: ``2^a <= |x| < 2^(a+1)``, and ``|x|``
rounds up to ``2^(a+1)`` with probability ``|x| / 2^a - 1 = 2m - 1`` (exact in floats), taken
where the uniform draw ``u`` of the element (:mod:`~grace_legacy.compressors.kernels.draws`) is
below it. With ``top`` the ``a + 1`` of the largest finite nonzero magnitude and
``bottom = top - 126``, the code is ``a - bottom + 1 + [rounded up]`` (1..127: ``2^(bottom - 1 + code)``);
below the range the neighbours are 0 and ``2^bottom``, and the code is ``[u < |x| / 2^bottom]``.
Bit 7 carries the sign of a nonzero code; 0 is zero, :data:`NON_FINITE_CODE` an inf or NaN.

Written twice: the torch formula (:func:`codes_reference`, which every device other than the CPU
runs) and loops compiled by numba that read the floats' bits (exponent field, mantissa) with the
same comparisons, so the two give the same bytes; :func:`codes` and :func:`decoded` pick one
(docs/DESIGN.md#compiled-passes).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled
from grace_legacy.compressors.kernels.draws import draw_pair, key_word, uniform

BLOCK = compiled.BLOCK
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


def codes_reference(x: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top, codes)`` of flat ``x`` (float32 or float64): ``top`` a 0-dim int tensor, ``codes``
    int tensor of the code bytes' values, by tensor arithmetic on ``x``'s device."""
    # In place wherever the tensor is this call's own: every fresh full-size tensor costs.
    magnitude = x.abs()
    finite = torch.isfinite(x)
    absent = (magnitude > 0).logical_and_(finite).logical_not_()
    mantissa, exponent = torch.frexp(magnitude.masked_fill_(~finite, 0.0))
    a = exponent - 1
    lowest = torch.iinfo(a.dtype).min
    top = torch.where(absent.all(), 0, a.masked_fill(absent, lowest).amax() + 1)
    bottom = top - (NATURAL_SPAN - 1)
    draw = uniform(key, x.numel(), x.dtype, x.device)
    code = (draw < 2 * mantissa - 1).to(a.dtype).add_(a).sub_(bottom - 1)
    below = a < bottom
    if bool(below.any()):  # elements some 2^126 under the largest: rare, so only then
        # e - bottom <= 0 here, so no overflow.
        below_code = (draw < mantissa * pow2(exponent - bottom, x.dtype)).to(a.dtype)
        code = torch.where(below, below_code, code)
    code.masked_fill_(absent, 0)
    # The sign bit only on nonzero codes (<= 127, so | 0x80 is + 0x80): 0x80 is kept for inf and NaN.
    code.add_((x < 0).logical_and_(code > 0), alpha=0x80)
    return top, code.masked_fill_(~finite, NON_FINITE_CODE)


def codes(x: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top, codes)`` of flat ``x`` (float32 or float64): ``top`` as a 1-element int16 tensor,
    the code bytes as uint8. The compiled loops on a CPU, else :func:`codes_reference`."""
    if not compiled.applies(x):
        top, code = codes_reference(x, key)
        return top.to(torch.int16).reshape(1), code.to(torch.uint8)
    array = x.numpy()
    bits = array.view(np.uint32 if array.itemsize == 4 else np.uint64)
    largest = compiled.run(_largest_finite, _largest_finite_parallel, array.size, array, bits)
    largest = float(np.array(largest, dtype=bits.dtype).view(array.dtype))
    # frexp's exponent grows with the magnitude: the largest's is every element's top.
    top = math.frexp(largest)[1] if largest > 0 else 0
    out = torch.empty(x.numel(), dtype=torch.uint8)
    arguments = (array, bits, top - (NATURAL_SPAN - 1), key_word(key), out.numpy())
    if compiled.run(_codes, _codes_parallel, array.size, *arguments):
        compiled.run(_rare_codes, _rare_codes_parallel, array.size, *arguments)
    return torch.tensor([top], dtype=torch.int16), out


@compiled.inline
def _layout(x):  # pragma: no cover - compiled
    """x's float layout: sign bit, exponent mask (in place), mantissa bits, exponent bias, and
    the value of the mantissa's last bit."""
    if compiled.is_single(x):
        return np.uint64(31), np.uint64(0x7F800000), np.uint64(23), 127, x.dtype.type(2.0**-23)
    return np.uint64(63), np.uint64(0x7FF0000000000000), np.uint64(52), 1023, x.dtype.type(2.0**-52)


@compiled.loop
def _largest_finite_range(x, bits, start, end):  # pragma: no cover - compiled
    # The largest finite magnitude's bits (0 if none, NaN skipped). On magnitude bits, which order
    # as the magnitudes do: an integer maximum vectorizes.
    sign, exponents, _, _, _ = _layout(x)
    magnitude_mask = (np.uint64(1) << sign) - np.uint64(1)
    largest = np.uint64(0)
    bits = bits[start:end]
    for i in range(bits.size):
        magnitude = np.uint64(bits[i]) & magnitude_mask
        if magnitude < exponents:  # finite
            largest = max(largest, magnitude)
    return largest


@compiled.loop
def _largest_finite(x, bits):  # pragma: no cover - compiled
    return _largest_finite_range(x, bits, 0, x.size)


@compiled.parallel_loop
def _largest_finite_parallel(x, bits):  # pragma: no cover - compiled
    count = (x.size + BLOCK - 1) // BLOCK
    partial = np.empty(count, np.uint64)
    for b in numba.prange(count):
        partial[b] = _largest_finite_range(x, bits, b * BLOCK, min(x.size, (b + 1) * BLOCK))
    return partial.max()


@compiled.inline
def _code(x, bits, i, u, bottom):  # pragma: no cover - compiled
    """Element i's code byte, or -1 if it is subnormal or some 2^126 under the largest: those
    are rare, and left to _rare_codes (a frexp call in this loop would slow every element)."""
    sign, exponents, mantissa_bits, bias, last_bit = _layout(x)
    word_bits = np.uint64(bits[i])
    magnitude = word_bits & ((np.uint64(1) << sign) - np.uint64(1))
    if magnitude >= exponents:  # inf or NaN
        return 0x80
    if magnitude == 0:
        return 0
    field = np.int64(magnitude >> mantissa_bits)
    a = field - bias  # |x| = (1 + f) * 2^a for a normal x, with f = 2m - 1 exact
    if field == 0 or a < bottom:
        return -1
    f = x.dtype.type(np.int64(magnitude & ((np.uint64(1) << mantissa_bits) - np.uint64(1)))) * last_bit
    # The code is at least 1, so the sign bit goes on without a test (a branch on a random
    # sign costs more than the rest of the element).
    return a - bottom + 1 + (1 if u < f else 0) + 0x80 * np.int64(word_bits >> sign)


# By pairs of elements, as QSGD's levels (qsgd_passes: why); returns how many were left as rare.
@compiled.loop
def _codes_range(x, bits, bottom, key, out, start, end):  # pragma: no cover - compiled
    rare = 0
    for j in range(start // 2, end // 2):
        u0, u1 = draw_pair(key, j, x)
        c0 = _code(x, bits, 2 * j, u0, bottom)
        c1 = _code(x, bits, 2 * j + 1, u1, bottom)
        out[2 * j], out[2 * j + 1] = max(c0, 0), max(c1, 0)
        rare += (c0 < 0) + (c1 < 0)
    if end % 2:
        c = _code(x, bits, end - 1, draw_pair(key, end // 2, x)[0], bottom)
        out[end - 1] = max(c, 0)
        rare += c < 0
    return rare


@compiled.loop
def _codes(x, bits, bottom, key, out):  # pragma: no cover - compiled
    return _codes_range(x, bits, bottom, key, out, 0, x.size)


@compiled.parallel_loop
def _codes_parallel(x, bits, bottom, key, out):  # pragma: no cover - compiled
    count = (x.size + BLOCK - 1) // BLOCK
    rare = np.empty(count, np.int64)
    for b in numba.prange(count):
        rare[b] = _codes_range(x, bits, bottom, key, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))
    return rare.sum()


@compiled.loop
def _rare_codes_range(x, bits, bottom, key, out, start, end):  # pragma: no cover - compiled
    for i in range(start, end):
        value = x[i]
        if _code(x, bits, i, x.dtype.type(0), bottom) >= 0:
            continue
        u = draw_pair(key, i // 2, x)[i % 2]
        mantissa, exponent = math.frexp(abs(value))
        a = exponent - 1
        if a >= bottom:
            code = a - bottom + 1 + (1 if u < 2 * mantissa - 1 else 0)
        else:  # the neighbours are 0 and 2^bottom
            code = 1 if u < mantissa * x.dtype.type(math.ldexp(1.0, exponent - bottom)) else 0
        out[i] = code + 0x80 if value < 0 and code > 0 else code


@compiled.loop
def _rare_codes(x, bits, bottom, key, out):  # pragma: no cover - compiled
    _rare_codes_range(x, bits, bottom, key, out, 0, x.size)


@compiled.parallel_loop
def _rare_codes_parallel(x, bits, bottom, key, out):  # pragma: no cover - compiled
    for b in numba.prange((x.size + BLOCK - 1) // BLOCK):
        _rare_codes_range(x, bits, bottom, key, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))


def decoding_table(top: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """The value (float32 or float64) of each of the 256 code bytes for ``top`` (a 1-element tensor):
    a code byte has 256 values, so they are decoded once and every element is looked up (one
    gather instead of a dozen elementwise passes)."""
    every_code = torch.arange(256, dtype=torch.int32, device=top.device)
    magnitude_code = every_code & 0x7F
    table = pow2(top.to(torch.int32) - NATURAL_SPAN + magnitude_code, work)
    table = torch.where(every_code >= 0x80, -table, table)
    table = torch.where(magnitude_code == 0, 0.0, table)
    return torch.where(every_code == NON_FINITE_CODE, float("nan"), table)


def decoded(top: torch.Tensor, codes: torch.Tensor, work: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The values of the code bytes ``codes`` (uint8) for ``top``, as ``dtype``: ``table[codes[i]]``
    for :func:`decoding_table`'s table in ``work``, by a compiled loop on a CPU, else ``index_select``."""
    table = decoding_table(top, work)
    if not compiled.applies(codes):
        return table.to(dtype).index_select(0, codes.to(torch.int32))
    out = torch.empty(codes.shape, dtype=table.dtype)
    compiled.run(_look_up, _look_up_parallel, codes.numel(), codes.numpy(), table.numpy(), out.numpy())
    return out.to(dtype)


@compiled.loop
def _look_up_range(codes, table, out, start, end):  # pragma: no cover - compiled
    codes, out = codes[start:end], out[start:end]
    for i in range(out.size):
        out[i] = table[codes[i]]


@compiled.loop
def _look_up(codes, table, out):  # pragma: no cover - compiled
    _look_up_range(codes, table, out, 0, codes.size)


@compiled.parallel_loop
def _look_up_parallel(codes, table, out):  # pragma: no cover - compiled
    for b in numba.prange((codes.size + BLOCK - 1) // BLOCK):
        _look_up_range(codes, table, out, b * BLOCK, min(codes.size, (b + 1) * BLOCK))
