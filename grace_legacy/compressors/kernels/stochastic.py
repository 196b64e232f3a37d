"""Compiled CPU passes of the stochastic quantizers (QSGD, TernGrad, natural compression): one loop
each that reads an element, draws its number inline (:mod:`~grace_legacy.compressors.kernels.draws`)
and writes its code, with the tensor formulas' float operations in their order, so the codes are
bit for bit theirs (docs/DESIGN.md#compiled-passes).

Every loop takes the flat gradient in its work dtype (float32 or float64). QSGD's and TernGrad's
also take a scale the caller has checked finite and positive; Natural's handles inf and NaN too.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled as _compiled
from grace_legacy.compressors.kernels.draws import GAMMA, MIX1, MIX2


def kernels_apply(tensor: torch.Tensor) -> bool:
    """Whether the compiled loops handle ``tensor``: any CPU tensor (converted to float32 or float64
    first) while ``compiled.ENABLED``."""
    return _compiled.applies(tensor)


def _single(x):  # pragma: no cover - replaced in compiled code, see _kernels
    """In compiled code, whether ``x`` holds float32 (else float64), a constant of the compilation."""
    raise NotImplementedError("_single is only defined inside compiled loops")


@functools.cache
def _kernels():
    import numba
    from numba.extending import overload

    # A constant per compiled type: a test of `x.itemsize`, read at run time, would keep both
    # dtypes' code in every loop.
    @overload(_single, inline="always")
    def _single_for(x):
        single = x.dtype.bitwidth == 32
        return lambda x: single

    compiled, inline = _compiled.loop(), _compiled.inline_loop()
    gamma, mix1, mix2 = np.uint64(GAMMA), np.uint64(MIX1), np.uint64(MIX2)

    @inline
    def word(key, j):  # pragma: no cover - compiled
        z = key + (j + np.uint64(1)) * gamma
        z = (z ^ (z >> np.uint64(30))) * mix1
        z = (z ^ (z >> np.uint64(27))) * mix2
        return z ^ (z >> np.uint64(31))

    @inline
    def draws(key, j, x):  # pragma: no cover - compiled
        """Draws 2j and 2j + 1 in x's dtype (see the draws module): whose bits convert exactly."""
        if _single(x):
            w = word(key, np.uint64(j))
            unit = x.dtype.type(2.0**-24)
            return (x.dtype.type(w >> np.uint64(40)) * unit,
                    x.dtype.type((w >> np.uint64(8)) & np.uint64(0xFFFFFF)) * unit)
        unit = x.dtype.type(2.0**-53)
        return (x.dtype.type(word(key, np.uint64(2 * j)) >> np.uint64(11)) * unit,
                x.dtype.type(word(key, np.uint64(2 * j + 1)) >> np.uint64(11)) * unit)

    # Each pass over elements goes by pairs, the pair a float32 word draws for, and then the last
    # element of an odd count: a bounds test inside the loop halves its speed. A `*_range` loop does
    # elements start .. end - 1 (start even: blocks are); `serial` drivers run one over everything
    # (or block by block, where partial sums make the order matter) and `parallel` ones run one
    # block per prange iteration, combining blocks' partial results in block order. Each loops
    # over slices of its range from 0 (compiled.py: why); draws take the element's own index.
    block = _compiled.BLOCK
    parallel = _compiled.parallel_loop()

    @compiled
    def squares_range(x, start, end):  # pragma: no cover - compiled
        # Four interleaved partial sums, so that the loop vectorizes: the order is part of the
        # result, and documented in sum_of_squares below.
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

    @compiled
    def sum_of_squares(x):  # pragma: no cover - compiled
        total = 0.0
        for b in range((x.size + block - 1) // block):
            total += squares_range(x, b * block, min(x.size, (b + 1) * block))
        return total

    @parallel
    def sum_of_squares_parallel(x):  # pragma: no cover - compiled
        count = (x.size + block - 1) // block
        partial = np.empty(count)
        for b in numba.prange(count):
            partial[b] = squares_range(x, b * block, min(x.size, (b + 1) * block))
        total = 0.0
        for b in range(count):
            total += partial[b]
        return total

    @compiled
    def sum_and_extremes_range(x, start, end):  # pragma: no cover - compiled
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

    @compiled
    def deviations_range(x, mean, start, end):  # pragma: no cover - compiled
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

    @compiled
    def spread(x):  # pragma: no cover - compiled
        # Two passes in float64: the mean (with the extremes), then the squared deviations from it.
        n = x.size
        total = 0.0
        lowest = highest = np.float64(x[0])
        for b in range((n + block - 1) // block):
            s, low, high = sum_and_extremes_range(x, b * block, min(n, (b + 1) * block))
            total += s
            if low < lowest:
                lowest = low
            if high > highest:
                highest = high
        mean = total / n
        deviations = 0.0
        for b in range((n + block - 1) // block):
            deviations += deviations_range(x, mean, b * block, min(n, (b + 1) * block))
        variance = deviations / n
        return np.sqrt(variance), lowest, highest, variance != variance

    @parallel
    def spread_parallel(x):  # pragma: no cover - compiled
        n = x.size
        count = (n + block - 1) // block
        sums, lows, highs = np.empty(count), np.empty(count), np.empty(count)
        for b in numba.prange(count):
            sums[b], lows[b], highs[b] = sum_and_extremes_range(x, b * block, min(n, (b + 1) * block))
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
            sums[b] = deviations_range(x, mean, b * block, min(n, (b + 1) * block))
        deviations = 0.0
        for b in range(count):
            deviations += sums[b]
        variance = deviations / n
        return np.sqrt(variance), lowest, highest, variance != variance

    @inline
    def qsgd_level(value, u, norm, s, one):  # pragma: no cover - compiled
        ratio = min(abs(value) / norm * s, s)
        level = np.floor(ratio)
        if u < ratio - level:
            level += one
        return np.int32(np.copysign(level, value))

    @compiled
    def qsgd_range(x, norm, s, key, out, start, end):  # pragma: no cover - compiled
        one = x.dtype.type(1)
        first = start // 2
        x, out, n = x[start:end], out[start:end], end - start
        for j in range(n // 2):
            u0, u1 = draws(key, first + j, x)
            out[2 * j] = qsgd_level(x[2 * j], u0, norm, s, one)
            out[2 * j + 1] = qsgd_level(x[2 * j + 1], u1, norm, s, one)
        if n % 2:
            out[n - 1] = qsgd_level(x[n - 1], draws(key, first + n // 2, x)[0], norm, s, one)

    @inline
    def ternary(value, u, bound, scale):  # pragma: no cover - compiled
        # Comparisons, not min and max (see spread): every value is finite here.
        clipped = value
        if clipped < -bound:
            clipped = -bound
        if clipped > bound:
            clipped = bound
        kept = np.int32(u < abs(clipped) / scale)
        return kept * (np.int32(clipped > 0) - np.int32(clipped < 0))

    @compiled
    def terngrad_range(x, bound, scale, key, out, start, end):  # pragma: no cover - compiled
        first = start // 2
        x, out, n = x[start:end], out[start:end], end - start
        for j in range(n // 2):
            u0, u1 = draws(key, first + j, x)
            out[2 * j] = ternary(x[2 * j], u0, bound, scale)
            out[2 * j + 1] = ternary(x[2 * j + 1], u1, bound, scale)
        if n % 2:
            out[n - 1] = ternary(x[n - 1], draws(key, first + n // 2, x)[0], bound, scale)

    @compiled
    def scaled_range(codes, scale, divisor, out, start, end):  # pragma: no cover - compiled
        codes, out = codes[start:end], out[start:end]
        for i in range(out.size):
            out[i] = scale * (out.dtype.type(codes[i]) / divisor)

    @inline
    def layout(x):  # pragma: no cover - compiled
        """x's float layout: sign bit, exponent mask (in place), mantissa bits, exponent bias, and
        the value of the mantissa's last bit."""
        if _single(x):
            return np.uint64(31), np.uint64(0x7F800000), np.uint64(23), 127, x.dtype.type(2.0**-23)
        return np.uint64(63), np.uint64(0x7FF0000000000000), np.uint64(52), 1023, x.dtype.type(2.0**-52)

    @compiled
    def largest_finite_range(x, bits, start, end):  # pragma: no cover - compiled
        # On magnitude bits, which order as the magnitudes do: an integer maximum vectorizes.
        sign, exponents, _, _, _ = layout(x)
        magnitude_mask = (np.uint64(1) << sign) - np.uint64(1)
        largest = np.uint64(0)
        bits = bits[start:end]
        for i in range(bits.size):
            magnitude = np.uint64(bits[i]) & magnitude_mask
            if magnitude < exponents:  # finite
                largest = max(largest, magnitude)
        return largest

    @parallel
    def largest_finite_parallel(x, bits):  # pragma: no cover - compiled
        count = (x.size + block - 1) // block
        partial = np.empty(count, np.uint64)
        for b in numba.prange(count):
            partial[b] = largest_finite_range(x, bits, b * block, min(x.size, (b + 1) * block))
        return partial.max()

    @inline
    def natural_code(x, bits, i, u, bottom):  # pragma: no cover - compiled
        """Element i's code byte, or -1 if it is subnormal or some 2^126 under the largest: those
        are rare, and left to natural_rare (a frexp call in this loop would slow every element)."""
        sign, exponents, mantissa_bits, bias, last_bit = layout(x)
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

    @compiled
    def natural_range(x, bits, bottom, key, out, start, end):  # pragma: no cover - compiled
        rare = 0
        for j in range(start // 2, end // 2):
            u0, u1 = draws(key, j, x)
            c0 = natural_code(x, bits, 2 * j, u0, bottom)
            c1 = natural_code(x, bits, 2 * j + 1, u1, bottom)
            out[2 * j], out[2 * j + 1] = max(c0, 0), max(c1, 0)
            rare += (c0 < 0) + (c1 < 0)
        if end % 2:
            c = natural_code(x, bits, end - 1, draws(key, end // 2, x)[0], bottom)
            out[end - 1] = max(c, 0)
            rare += c < 0
        return rare

    @compiled
    def natural_rare_range(x, bits, bottom, key, out, start, end):  # pragma: no cover - compiled
        for i in range(start, end):
            value = x[i]
            if natural_code(x, bits, i, x.dtype.type(0), bottom) >= 0:
                continue
            u = draws(key, i // 2, x)[i % 2]
            mantissa, exponent = math.frexp(abs(value))
            a = exponent - 1
            if a >= bottom:
                code = a - bottom + 1 + (1 if u < 2 * mantissa - 1 else 0)
            else:  # the neighbours are 0 and 2^bottom
                code = 1 if u < mantissa * x.dtype.type(math.ldexp(1.0, exponent - bottom)) else 0
            out[i] = code + 0x80 if value < 0 and code > 0 else code

    @compiled
    def look_up_range(codes, table, out, start, end):  # pragma: no cover - compiled
        codes, out = codes[start:end], out[start:end]
        for i in range(out.size):
            out[i] = table[codes[i]]

    # The drivers: `serial` runs a range loop over everything on the calling thread, `parallel`
    # one block per prange iteration (element-wise, so the blocks cannot change a result).
    @compiled
    def qsgd(x, norm, s, key, out):  # pragma: no cover - compiled
        qsgd_range(x, norm, s, key, out, 0, x.size)

    @parallel
    def qsgd_parallel(x, norm, s, key, out):  # pragma: no cover - compiled
        for b in numba.prange((x.size + block - 1) // block):
            qsgd_range(x, norm, s, key, out, b * block, min(x.size, (b + 1) * block))

    @compiled
    def terngrad(x, bound, scale, key, out):  # pragma: no cover - compiled
        terngrad_range(x, bound, scale, key, out, 0, x.size)

    @parallel
    def terngrad_parallel(x, bound, scale, key, out):  # pragma: no cover - compiled
        for b in numba.prange((x.size + block - 1) // block):
            terngrad_range(x, bound, scale, key, out, b * block, min(x.size, (b + 1) * block))

    @compiled
    def scaled(codes, scale, divisor, out):  # pragma: no cover - compiled
        scaled_range(codes, scale, divisor, out, 0, codes.size)

    @parallel
    def scaled_parallel(codes, scale, divisor, out):  # pragma: no cover - compiled
        for b in numba.prange((codes.size + block - 1) // block):
            scaled_range(codes, scale, divisor, out, b * block, min(codes.size, (b + 1) * block))

    @compiled
    def largest_finite(x, bits):  # pragma: no cover - compiled
        return largest_finite_range(x, bits, 0, x.size)

    @compiled
    def natural(x, bits, bottom, key, out):  # pragma: no cover - compiled
        return natural_range(x, bits, bottom, key, out, 0, x.size)

    @parallel
    def natural_parallel(x, bits, bottom, key, out):  # pragma: no cover - compiled
        count = (x.size + block - 1) // block
        rare = np.empty(count, np.int64)
        for b in numba.prange(count):
            rare[b] = natural_range(x, bits, bottom, key, out, b * block, min(x.size, (b + 1) * block))
        return rare.sum()

    @compiled
    def natural_rare(x, bits, bottom, key, out):  # pragma: no cover - compiled
        natural_rare_range(x, bits, bottom, key, out, 0, x.size)

    @parallel
    def natural_rare_parallel(x, bits, bottom, key, out):  # pragma: no cover - compiled
        for b in numba.prange((x.size + block - 1) // block):
            natural_rare_range(x, bits, bottom, key, out, b * block, min(x.size, (b + 1) * block))

    @compiled
    def look_up(codes, table, out):  # pragma: no cover - compiled
        look_up_range(codes, table, out, 0, codes.size)

    @parallel
    def look_up_parallel(codes, table, out):  # pragma: no cover - compiled
        for b in numba.prange((codes.size + block - 1) // block):
            look_up_range(codes, table, out, b * block, min(codes.size, (b + 1) * block))

    def both(serial, parallel_driver):
        return SimpleNamespace(serial=serial, parallel=parallel_driver)

    return SimpleNamespace(
        sum_of_squares=both(sum_of_squares, sum_of_squares_parallel), spread=both(spread, spread_parallel),
        largest_finite=both(largest_finite, largest_finite_parallel), qsgd=both(qsgd, qsgd_parallel),
        terngrad=both(terngrad, terngrad_parallel), natural=both(natural, natural_parallel),
        natural_rare=both(natural_rare, natural_rare_parallel), scaled=both(scaled, scaled_parallel),
        look_up=both(look_up, look_up_parallel))


def _run(name: str, n: int, *args):
    """Kernel ``name`` over ``n`` elements, on as many threads as :mod:`~grace_legacy.compressors.kernels.compiled`
    gives it."""
    kernel = getattr(_kernels(), name)
    return _compiled.run(kernel.serial, kernel.parallel, n, *args)


def _word(key: int) -> np.uint64:
    return np.uint64(key & (2**64 - 1))


def sum_of_squares(x: torch.Tensor) -> float:
    """The sum of the float64 squares of ``x``'s elements, in an order fixed by the element count
    alone: each block of :data:`~grace_legacy.compressors.kernels.compiled.BLOCK` elements sums
    into four partial sums, of the elements at positions 0, 1, 2, 3 modulo 4 (the block's last
    ``len % 4`` go to the first), added as ``(s0 + s1) + (s2 + s3)``; the blocks' sums are added
    in block order."""
    return _run("sum_of_squares", x.numel(), x.numpy())


def spread(x: torch.Tensor) -> tuple[float, float, float]:
    """``(sigma, lowest, highest)`` of ``x``: the standard deviation (dividing by n, two float64
    passes summed by blocks as :func:`sum_of_squares` is) and the extremes; all NaN if an element is
    NaN (sigma also if one is infinite)."""
    sigma, lowest, highest, not_finite = _run("spread", x.numel(), x.numpy())
    if not_finite and bool(torch.isnan(x).any()):  # the extremes skip NaN
        return math.nan, math.nan, math.nan
    return sigma, lowest, highest


def qsgd_levels(x: torch.Tensor, norm: float, s: int, key: int, out: torch.Tensor) -> None:
    """QSGD's signed levels of ``x`` into ``out`` (see :class:`~grace_legacy.QSGD`)."""
    work = x.numpy().dtype.type
    _run("qsgd", x.numel(), x.numpy(), work(norm), work(s), _word(key), out.numpy())


def terngrad_digits(x: torch.Tensor, bound: float, scale: float, key: int, out: torch.Tensor) -> None:
    """TernGrad's ternary digits of ``x`` clipped to ``[-bound, bound]`` into ``out``."""
    work = x.numpy().dtype.type
    _run("terngrad", x.numel(), x.numpy(), work(bound), work(scale), _word(key), out.numpy())


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.itemsize == 4 else np.uint64)


def largest_finite_magnitude(x: torch.Tensor) -> float:
    """The largest finite ``|x_i|`` (0 when there is none); NaN is skipped."""
    array = x.numpy()
    largest = _run("largest_finite", array.size, array, _bits(array))
    return float(np.array(largest, dtype=_bits(array).dtype).view(array.dtype))


def natural_codes(x: torch.Tensor, bottom: int, key: int, out: torch.Tensor) -> None:
    """Natural compression's code bytes of ``x`` (every element, inf and NaN included) into
    ``out`` (uint8), for the covered range's lowest exponent ``bottom``."""
    array, codes = x.numpy(), out.numpy()
    if _run("natural", array.size, array, _bits(array), bottom, _word(key), codes):
        _run("natural_rare", array.size, array, _bits(array), bottom, _word(key), codes)


def scaled_codes(codes: torch.Tensor, scale: float, divisor: int, work: torch.dtype) -> torch.Tensor:
    """``scale * (codes[i] / divisor)`` for every code, computed in ``work`` (float32 or float64):
    the decoding of QSGD (divisor: the levels) and TernGrad (divisor 1)."""
    out = torch.empty(codes.shape, dtype=work)
    dtype = out.numpy().dtype.type
    _run("scaled", codes.numel(), codes.numpy(), dtype(scale), dtype(divisor), out.numpy())
    return out


def look_up(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[codes[i]]`` for every code (uint8 codes, a 256-entry float32 or float64 table)."""
    out = torch.empty(codes.shape, dtype=table.dtype)
    _run("look_up", codes.numel(), codes.numpy(), table.numpy(), out.numpy())
    return out
