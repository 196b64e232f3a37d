"""TernGrad: stochastic rounding to -1, 0, +1 times a clipped scale (conventions in
:mod:`grace_legacy.compressors.quantization`)."""

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
    float32_at_least,
    round_to,
    scale_part,
    usable_scale,
    work_dtype,
)
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.runtime.validation import check_gradient

#: TernGrad clips at ``CLIP_SIGMAS`` standard deviations, as Wen et al. do.
CLIP_SIGMAS = 2.5


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
    A zero tensor sends ``s = 0`` and decodes to zeros. Any floating dtype. No parameter.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = check_seed(seed, "TernGrad")

    def clip_bound(self, x: torch.Tensor) -> tuple[float, float]:
        """``(bound, largest)`` of flat ``x`` (in the work dtype): the clipping bound
        ``2.5 * sigma`` rounded to the work dtype (inf for an all-equal tensor), and the largest
        ``|x_i|``; both NaN when an element is NaN. Sigma divides by n and is taken in float64
        (a float32 sum of squares overflows where sigma itself fits), then rounded to the work
        dtype: on a CPU from two passes (:func:`~grace_legacy.compressors.kernels.stochastic.spread`),
        elsewhere from ``torch.std``, so the two may differ in its last bit."""
        if stochastic.kernels_apply(x):
            sigma, lowest, highest = stochastic.spread(x)
        else:
            lowest, highest = torch.aminmax(x)
            wide = x.to(torch.float64)
            sigma, lowest, highest = torch.stack([torch.std(wide, correction=0), lowest.to(wide.dtype),
                                                  highest.to(wide.dtype)]).tolist()
        sigma = round_to(sigma, x.dtype)
        # Compared exactly, not as sigma == 0: a rounded sigma of an all-equal tensor may not be 0.
        bound = math.inf if highest == lowest else round_to(CLIP_SIGMAS * sigma, x.dtype)
        largest = math.nan if math.isnan(lowest) or math.isnan(highest) else max(abs(lowest), abs(highest))
        return bound, largest

    def clipped(self, tensor: torch.Tensor) -> torch.Tensor:
        """The clipped gradient ``g_c`` (flat, in the arithmetic dtype) that TernGrad estimates."""
        x = tensor.detach().reshape(-1).to(work_dtype(tensor.dtype))
        bound, _ = self.clip_bound(x)
        return torch.clamp(x, min=-bound, max=bound)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "TernGrad")
        work = work_dtype(tensor.dtype)
        x = tensor.detach().reshape(-1).to(work)
        key = draw_key(self, self.seed, name)
        ctx = ScaledContext(tensor.shape, tensor.dtype, work)
        bound, largest = self.clip_bound(x)
        # The largest clipped magnitude; NaN (decoding to NaN everywhere) if either is NaN.
        scale = float32_at_least(math.nan if math.isnan(bound) else min(largest, bound))
        if not usable_scale(scale):  # a zero tensor, or inf or NaN in it: decodes to zeros or NaN
            ternary = torch.zeros(x.numel(), dtype=torch.int8, device=x.device)
        elif stochastic.kernels_apply(x):
            ternary = torch.empty(x.numel(), dtype=torch.int8)
            stochastic.terngrad_digits(x, bound, scale, key, ternary)
        else:  # every element is finite here
            clipped = torch.clamp(x, min=-bound, max=bound)
            dropped = uniform(key, x.numel(), work, x.device) >= clipped.abs().div_(x.new_tensor(scale))
            ternary = clipped.sign_().masked_fill_(dropped, 0.0).to(torch.int8)
        return [scale_part(scale, x.device), ternary], ctx

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
        return NoMemory()
