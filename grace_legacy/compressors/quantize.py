"""Unbiased stochastic quantizers: QSGD, TernGrad and natural compression.

Each one rounds every element at random to one of two neighbouring points of a coarse grid, with
the probabilities that make the expected value the input, so the compressed gradient is an
unbiased estimate and needs no error feedback (their recommended memory is ``NoMemory``).

Shared conventions:

* The draws are :func:`~grace_legacy.compressors.draws.uniform` of the key
  ``derived_seed(seed, rank, name, step)``: every rank draws its own numbers, the global RNG is
  never touched, every device draws the same numbers, and a test can replay any rank.
* On a CPU each quantizer is one compiled pass (:mod:`~grace_legacy.compressors.stochastic`) after
  its scale is known; elsewhere it is tensor arithmetic. Both give the same codes for the same
  scale (tested). QSGD's norm sums its squares in a fixed order on a CPU and in the device's own
  order elsewhere, so the two may differ in its last float32 bit. Each quantizer reads its scale
  back to the host once per tensor (on a GPU, one synchronization), to choose its path.
* Arithmetic runs in float64 for float64 gradients and in float32 for float32, float16 and bfloat16
  ones (which float32 holds exactly); :meth:`decompress` returns the gradient's own dtype, so a
  decoded value is finally rounded to it (for float16, one beyond 65504 becomes inf, as with
  ``FP16``).
* QSGD and TernGrad send their scale as float32, rounded *up* from the exact one, so a
  probability never exceeds 1 and the estimate stays unbiased with respect to the scale actually
  sent. A gradient that holds inf or NaN, or whose scale exceeds float32's range (about 3.4e38),
  decodes to NaN everywhere, so a loss scaler still sees the overflow. Natural compression marks
  such elements one by one (see :class:`Natural`).
* Unbiasedness holds up to the resolution of the uniform draws (2**-24 in float32, 2**-53 in
  float64) and the rounding of one division per element.
* Payloads differ between ranks (each has its own scale), so they are gathered; every part's size
  is a function of the element count alone, so the gather needs no size header. The per-tensor
  scalar comes first in the payload, so the packed buffer is its size plus the elements' bytes,
  rounded up to a multiple of 8, with no padding in between.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from grace_legacy.compressors import stochastic
from grace_legacy.compressors.draws import uniform
from grace_legacy.core import Compressor, Knob, Memory, Payload, check_gradient

LEVELS = Knob("levels", low=1, high=2**31 - 1, integer=True)

#: The most levels QSGD accepts: signed levels travel as at most int32.
MAX_LEVELS = 2**31 - 1

#: TernGrad clips at ``CLIP_SIGMAS`` standard deviations, as Wen et al. do.
CLIP_SIGMAS = 2.5

_INF = float("inf")


def _check_seed(seed: Any, owner: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{owner}: seed must be an int, got {seed!r}")
    return seed


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, float16 and bfloat16 are all exact in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def float32_at_least(value: float) -> float:
    """The least float32 at or above ``value`` (as a Python float): a scale that is never below
    the exact one keeps every probability ``|x| / scale`` at most 1. inf and NaN stay what they
    are; beyond float32's range is inf."""
    if math.isnan(value) or math.isinf(value):
        return value
    if value > FLOAT32_MAX:
        return _INF
    if value < -FLOAT32_MAX:
        return -FLOAT32_MAX
    rounded = np.float32(value)
    # Compared as Python floats: numpy would compare in float32, where the two are equal.
    return float(rounded) if float(rounded) >= value else float(np.nextafter(rounded, np.float32(_INF)))


def _round_to(value: float, work: torch.dtype) -> float:
    """``value`` rounded to nearest in ``work`` (float32 or float64), as tensor arithmetic in
    ``work`` would give it (inf beyond float32's range)."""
    if work == torch.float64:
        return value
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def draw_key(compressor: Compressor, seed: int, name: str) -> int:
    """The key of this step's draws for tensor ``name``; counts the step."""
    return compressor.step_seed(seed, name, compressor.next_step(name))


def _usable(scale: float) -> bool:
    """Whether ``scale`` can divide: finite and positive (never NaN)."""
    return 0 < scale < _INF


class ScaledContext(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    work: torch.dtype


def _scale_part(scale: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([scale], dtype=torch.float32, device=device)


# -- QSGD ---------------------------------------------------------------------------------------


def level_dtype(levels: int) -> torch.dtype:
    """The smallest signed integer dtype holding ``[-levels, levels]``."""
    if levels <= 127:
        return torch.int8
    if levels <= 32767:
        return torch.int16
    if levels <= MAX_LEVELS:
        return torch.int32
    raise ValueError(f"QSGD: levels must be at most {MAX_LEVELS}, got {levels}")


#: Below this float64 norm, squares of elements under about 2**-537 (float64 gradients only) may
#: have underflowed enough to matter, so the norm is taken again from rescaled elements.
TINY_NORM = 2.0**-450


def _norm(x: torch.Tensor) -> float:
    """The 2-norm of flat ``x``: squares summed in float64 (float32 squares overflow from
    |x_i| ~ 1.8e19 on), on a CPU in the order :func:`~grace_legacy.compressors.stochastic.sum_of_squares`
    documents, elsewhere in the device's."""
    if stochastic.kernels_apply(x):
        norm = math.sqrt(stochastic.sum_of_squares(x))
    else:
        norm = torch.linalg.vector_norm(x, dtype=torch.float64).item()
    if norm < TINY_NORM:  # rare: all-zero, or elements tiny enough that squares underflow
        largest = x.abs().amax()
        if bool(largest == 0):
            return 0.0
        # Scaled exactly, by powers of two, so that the largest magnitude is in [0.5, 1); in two
        # halves, since 2**1074 (for the least subnormal) is beyond float64.
        exponent = torch.frexp(largest).exponent.to(torch.float64)
        half = torch.floor(-exponent / 2)
        scaled = x.to(torch.float64) * torch.exp2(half) * torch.exp2(-exponent - half)
        norm = (torch.linalg.vector_norm(scaled, dtype=torch.float64) * torch.exp2(exponent)).item()
    return norm


class QSGDContext(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    work: torch.dtype
    levels: int


class QSGD(Compressor):
    """QSGD (Alistarh et al., 2017) with ``s = levels`` quantization levels.

    With ``r_i = |v_i| / ||v||_2 * s`` in ``[0, s]``, element ``i`` becomes the integer
    ``l_i = ceil(r_i)`` with probability ``r_i - floor(r_i)`` and ``floor(r_i)`` otherwise, and is
    decoded as ``||v|| * sign(v_i) * l_i / s``. So ``E[decoded] = v`` and
    ``E||decoded - v||^2 <= min(n / s^2, sqrt(n) / s) * ||v||^2``.

    Payload: ``[norm, signed_levels]``: the norm as one float32 (rounded up, see the module
    docstring) and ``sign(v_i) * l_i`` in the smallest signed integer dtype holding ``[-s, s]``:
    int8 for ``s <= 127`` (1 byte per element), int16 for ``s <= 32767`` (2 bytes), int32 up to
    ``s = 2**31 - 1`` (4 bytes; more levels are refused). Packed: ``4 + n * bytes`` rounded up to
    a multiple of 8. A zero tensor sends norm 0 and levels 0 and decodes to zeros.

    Any floating dtype. With more than ``2**24`` levels the arithmetic runs in float64, because
    float32 no longer holds every level exactly. ``levels`` is the knob ``Legacy`` schedules.
    """

    knob = LEVELS

    def __init__(self, levels: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self._set_knob(levels)
        self.seed = _check_seed(seed, "QSGD")

    @property
    def levels(self) -> int | None:
        return self.knob_value

    def _work(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if self.levels > 2**24 else _work_dtype(dtype)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "QSGD")
        self.check_ready()
        s = self.levels
        work = self._work(tensor.dtype)
        x = tensor.detach().reshape(-1).to(work)
        key = draw_key(self, self.seed, name)
        ctx = QSGDContext(tensor.shape, tensor.dtype, work, s)
        norm = float32_at_least(_norm(x))
        if not _usable(norm):  # a zero tensor, or inf or NaN in it: decodes to zeros or NaN
            signed = torch.zeros(x.numel(), dtype=level_dtype(s), device=x.device)
        elif stochastic.kernels_apply(x):
            signed = torch.empty(x.numel(), dtype=level_dtype(s))
            stochastic.qsgd_levels(x, norm, s, key, signed)
        else:
            signed = self._tensor_levels(x, norm, key)
        return [_scale_part(norm, x.device), signed], ctx

    def _tensor_levels(self, x: torch.Tensor, norm: float, key: int) -> torch.Tensor:
        s = self.levels
        work = x.dtype
        # Divided first: an element equal to the norm (any 1-element tensor) gets exactly s.
        # In place from here on: each pass writes into a tensor this call made (fresh memory
        # is costly).
        ratio = x.abs().div_(x.new_tensor(norm)).mul_(s)
        ratio.clamp_(0, s)  # only undoes a last-bit rounding of a float64 gradient's norm
        level = ratio.floor()
        # The draw becomes 1.0 where it falls below the fractional part: the chance of rounding up.
        level += uniform(key, x.numel(), work, x.device).lt_(ratio.sub_(level))
        # copysign, not where(x < 0, -l, l): the two differ only at l = 0 (-0.0), the same integer.
        return level.copysign_(x).to(level_dtype(s))

    def decompress(self, payload: Payload, ctx: QSGDContext) -> torch.Tensor:
        norm, signed = payload
        # l / s first: the extreme levels +-s then give the norm itself, with no rounding.
        if stochastic.kernels_apply(signed):
            decoded = stochastic.scaled_codes(signed, float(norm), ctx.levels, ctx.work)
        else:
            decoded = norm.to(ctx.work) * (signed.to(ctx.work) / ctx.levels)
        return decoded.to(ctx.dtype).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, torch.float32), (numel, level_dtype(self.levels))]

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels!r}, seed={self.seed})"

    def recommended_memory(self) -> Memory:
        """``NoMemory``: the estimate is unbiased, so there is no systematic error to feed back."""
        from grace_legacy.memories import NoMemory

        return NoMemory()


# -- TernGrad -----------------------------------------------------------------------------------


class TernGrad(Compressor):
    """TernGrad (Wen et al., 2017): a scale and one ternary digit per element.

    Clipping (the paper's scalar clipping): with ``sigma`` the standard deviation of the gradient's
    elements (about their mean, dividing by ``n``), ``g_c = clamp(g, -2.5 * sigma, 2.5 * sigma)``.
    A tensor whose elements are all equal (every 1-element tensor among them) has ``sigma = 0``
    and no outliers; clipping it would send zeros forever, so it is left unclipped (and is then
    sent exactly).

    With ``s = max_i |g_c,i|``, ``t_i = sign(g_c,i)`` with probability ``|g_c,i| / s`` and ``0``
    otherwise; the decoded value is ``s * t_i``. So ``E[decoded] = g_c`` (unbiased with respect to
    the *clipped* gradient) and ``E||decoded - g_c||^2 = sum_i |g_c,i| (s - |g_c,i|) <= s ||g_c||_1``.

    Payload: ``[s, t]``: ``s`` as one float32 (rounded up for float64 gradients) and ``t`` as int8
    in ``{-1, 0, 1}``: 1 byte per element, packed as ``4 + n`` rounded up to a multiple of 8.
    A zero tensor sends ``s = 0`` and decodes to zeros. Any floating dtype. No knob.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = _check_seed(seed, "TernGrad")

    def clip_bound(self, x: torch.Tensor) -> tuple[float, float]:
        """``(bound, largest)`` of flat ``x`` (in the work dtype): the clipping bound
        ``2.5 * sigma`` rounded to the work dtype (inf for an all-equal tensor), and the largest
        ``|x_i|``; both NaN when an element is NaN. Sigma divides by n and is taken in float64
        (a float32 sum of squares overflows where sigma itself fits), then rounded to the work
        dtype: on a CPU from two passes (:func:`~grace_legacy.compressors.stochastic.spread`),
        elsewhere from ``torch.std``, so the two may differ in its last bit."""
        if stochastic.kernels_apply(x):
            sigma, lowest, highest = stochastic.spread(x)
        else:
            lowest, highest = torch.aminmax(x)
            wide = x.to(torch.float64)
            sigma, lowest, highest = torch.stack([torch.std(wide, correction=0), lowest.to(wide.dtype),
                                                  highest.to(wide.dtype)]).tolist()
        sigma = _round_to(sigma, x.dtype)
        # Compared exactly, not as sigma == 0: a rounded sigma of an all-equal tensor may not be 0.
        bound = _INF if highest == lowest else _round_to(CLIP_SIGMAS * sigma, x.dtype)
        largest = math.nan if math.isnan(lowest) or math.isnan(highest) else max(abs(lowest), abs(highest))
        return bound, largest

    def clipped(self, tensor: torch.Tensor) -> torch.Tensor:
        """The clipped gradient ``g_c`` (flat, in the arithmetic dtype) that TernGrad estimates."""
        x = tensor.detach().reshape(-1).to(_work_dtype(tensor.dtype))
        bound, _ = self.clip_bound(x)
        return torch.clamp(x, min=-bound, max=bound)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "TernGrad")
        work = _work_dtype(tensor.dtype)
        x = tensor.detach().reshape(-1).to(work)
        key = draw_key(self, self.seed, name)
        ctx = ScaledContext(tensor.shape, tensor.dtype, work)
        bound, largest = self.clip_bound(x)
        # The largest clipped magnitude; NaN (decoding to NaN everywhere) if either is NaN.
        scale = float32_at_least(math.nan if math.isnan(bound) else min(largest, bound))
        if not _usable(scale):  # a zero tensor, or inf or NaN in it: decodes to zeros or NaN
            ternary = torch.zeros(x.numel(), dtype=torch.int8, device=x.device)
        elif stochastic.kernels_apply(x):
            ternary = torch.empty(x.numel(), dtype=torch.int8)
            stochastic.terngrad_digits(x, bound, scale, key, ternary)
        else:  # every element is finite here
            clipped = torch.clamp(x, min=-bound, max=bound)
            dropped = uniform(key, x.numel(), work, x.device) >= clipped.abs().div_(x.new_tensor(scale))
            ternary = clipped.sign_().masked_fill_(dropped, 0.0).to(torch.int8)
        return [_scale_part(scale, x.device), ternary], ctx

    def decompress(self, payload: Payload, ctx: ScaledContext) -> torch.Tensor:
        scale, ternary = payload
        if stochastic.kernels_apply(ternary):
            decoded = stochastic.scaled_codes(ternary, float(scale), 1, ctx.work)
        else:
            decoded = scale.to(ctx.work) * ternary.to(ctx.work)
        return decoded.to(ctx.dtype).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, torch.float32), (numel, torch.int8)]

    def __repr__(self) -> str:
        return f"TernGrad(seed={self.seed})"

    def recommended_memory(self) -> Memory:
        """``NoMemory``: unbiased for the clipped gradient, and clipping is deliberate, not an error
        to carry over."""
        from grace_legacy.memories import NoMemory

        return NoMemory()


# -- Natural compression ------------------------------------------------------------------------

#: Exponents a code byte covers below the tensor's top exponent.
NATURAL_SPAN = 127
#: The code byte of an element that was inf or NaN.
NON_FINITE_CODE = 0x80

# Per float dtype: the integer dtype of its bits, mantissa bits, exponent bias, least exponent.
_LAYOUT = {torch.float32: (torch.int32, 23, 127, -149), torch.float64: (torch.int64, 52, 1023, -1074)}


def pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2 ** exponent`` exactly, as float32 or float64, built from its bits: subnormal powers
    where the dtype has them, 0 below, inf above. (``torch.pow`` may miss by an ulp.)"""
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
    powers of two around it.

    For ``2^a <= |x| < 2^(a+1)``, ``|x|`` becomes ``2^(a+1)`` with probability ``|x| / 2^a - 1`` and
    ``2^a`` otherwise, keeping its sign: ``E[C(x)] = x`` and ``E[(C(x) - x)^2] <= x^2 / 8``.
    Zeros stay zero; subnormal inputs follow the same rule (their exponents are exact).

    On the wire: ``[top, codes]``. ``top`` (one int16) is ``a + 1`` for the largest finite
    nonzero ``|x|``; an all-zero tensor sends 0. One byte per element: bit 7 is the sign and bits
    0-6 a code ``c``:

    * ``c = 0``: zero (``0x00``);
    * ``c`` in ``1..127``: ``2^(top - 127 + c)``, so the byte covers the 127 binades
      ``2^(top - 126) .. 2^top``: every power the rule can produce for elements within a factor
      ``2^-126`` of the largest;
    * ``0x80`` (negative zero's code): the element was inf or NaN; it decodes to NaN.

    An element below the covered range (``|x| < 2^(top - 126)``: some 2^125 times smaller than
    the largest, possible in float32, bfloat16 and float64 but not within float16's narrower
    range) becomes ``2^(top - 126)`` with probability ``|x| / 2^(top - 126)`` and 0 otherwise:
    still unbiased. Nothing is above the
    range, since ``top`` follows the tensor; but an element in its dtype's last binade
    (``|x| >= 2^15`` in float16, ``2^127`` in float32) may round up to a power the dtype cannot
    hold and become inf.

    Bytes: ``2 + n`` rounded up to a multiple of 8. Any floating dtype; pure tensor arithmetic
    (``frexp`` and integer shifts), so it runs on CPU and GPU alike (one host sync per tensor
    decides whether the rare below-range rule is needed at all). No knob.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = _check_seed(seed, "Natural")

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "Natural")
        work = _work_dtype(tensor.dtype)
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
        from grace_legacy.memories import NoMemory

        return NoMemory()
