"""QSGD: stochastic rounding to ``s`` levels of the norm (see :mod:`~grace_legacy.compressors.quantization`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from grace_legacy.compressors.kernels import stochastic
from grace_legacy.compressors.kernels.draws import uniform
from grace_legacy.compressors.quantization import (
    check_seed,
    draw_key,
    float32_at_least,
    scale_part,
    usable_scale,
    work_dtype,
)
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.runtime.validation import check_gradient

LEVELS = ScheduledParameter("levels", low=1, high=2**31 - 1, integer=True)


#: The most levels QSGD accepts: signed levels travel as at most int32.
MAX_LEVELS = 2**31 - 1


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
    """The 2-norm of flat ``x``, squares summed in float64 (float32 squares overflow), on a CPU in
    :func:`~grace_legacy.compressors.kernels.stochastic.sum_of_squares`' order."""
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
    """QSGD (Alistarh et al., 2017) with ``s = levels`` quantization levels (the scheduled parameter).

    With ``r_i = |v_i| / ||v||_2 * s`` in ``[0, s]``, element ``i`` becomes ``l_i = ceil(r_i)`` with
    probability ``r_i - floor(r_i)``, else ``floor(r_i)``, decoded as ``||v|| * sign(v_i) * l_i / s``:
    ``E[decoded] = v`` and ``E||decoded - v||^2 <= min(n / s^2, sqrt(n) / s) * ||v||^2``.

    Payload ``[norm, signed_levels]``: the norm as one float32 (rounded up) and ``sign(v_i) * l_i``
    as int8 for ``s <= 127``, int16 for ``s <= 32767``, int32 up to ``2**31 - 1`` (more are
    refused): ``4 + n * bytes`` rounded up to a multiple of 8. A zero tensor decodes to zeros. Any
    floating dtype; above ``2**24`` levels the arithmetic runs in float64 (float32 no longer holds
    every level)."""

    parameter = LEVELS

    def __init__(self, levels: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self._set_value(levels)
        self.seed = check_seed(seed, "QSGD")

    @property
    def levels(self) -> int | None:
        return self.value

    def _work(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if self.levels > 2**24 else work_dtype(dtype)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "QSGD")
        self.check_ready()
        s = self.levels
        work = self._work(tensor.dtype)
        x = tensor.detach().reshape(-1).to(work)
        key = draw_key(self, self.seed, name)
        ctx = QSGDContext(tensor.shape, tensor.dtype, work, s)
        norm = float32_at_least(_norm(x))
        if not usable_scale(norm):  # a zero tensor, or inf or NaN in it: decodes to zeros or NaN
            signed = torch.zeros(x.numel(), dtype=level_dtype(s), device=x.device)
        elif stochastic.kernels_apply(x):
            signed = torch.empty(x.numel(), dtype=level_dtype(s))
            stochastic.qsgd_levels(x, norm, s, key, signed)
        else:
            signed = self._tensor_levels(x, norm, key)
        return [scale_part(norm, x.device), signed], ctx

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
        """``NoMemory``: the estimate is unbiased."""
        return NoMemory()
