"""TernGrad: stochastic rounding to -1, 0, +1 times a clipped scale (see
:mod:`~grace_legacy.compressors.quantization`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from grace_legacy.compressors.kernels import qsgd_passes, terngrad_passes
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
from grace_legacy.core.compressor import Payload, Randomized
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.runtime.validation import check_gradient

#: TernGrad clips at ``CLIP_SIGMAS`` standard deviations, as Wen et al. do.
CLIP_SIGMAS = 2.5


class TernGrad(Randomized):
    """TernGrad (Wen et al., 2017): a scale and one ternary digit per element.

    Clipping: ``g_c = clamp(g, -2.5 sigma, 2.5 sigma)``, ``sigma`` the elements' standard deviation
    (dividing by ``n``); a tensor whose elements are all equal (``sigma = 0``) is left unclipped
    (not sent as zeros forever), and so sent exactly. With ``s = max_i |g_c,i|``,
    ``t_i = sign(g_c,i)`` with probability ``|g_c,i| / s``, else 0, decoded as ``s * t_i``:
    ``E[decoded] = g_c`` (unbiased for the *clipped* gradient) and
    ``E||decoded - g_c||^2 = sum_i |g_c,i| (s - |g_c,i|) <= s ||g_c||_1``.

    Payload ``[s, t]``: ``s`` as one float32 (rounded up), ``t`` as int8: ``4 + n`` bytes rounded up
    to a multiple of 8. A zero tensor decodes to zeros. Any floating dtype; no parameter."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = check_seed(seed, "TernGrad")

    def clip_bound(self, x: torch.Tensor) -> tuple[float, float]:
        """``(bound, largest)`` of flat ``x``: the clipping bound ``2.5 * sigma`` (inf for an
        all-equal tensor) and the largest ``|x_i|``, rounded to ``x``'s dtype, both NaN when an
        element is. Sigma is taken in float64; a CPU's and ``torch.std``'s may differ in the last bit."""
        sigma, lowest, highest = terngrad_passes.spread(x)
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
        if usable_scale(scale):  # then every element is finite
            ternary = terngrad_passes.digits(x, bound, scale, key)
        else:  # a zero tensor, or inf or NaN in it: decodes to zeros or NaN
            ternary = torch.zeros(x.numel(), dtype=torch.int8, device=x.device)
        return [scale_part(scale, x.device), ternary], ctx

    def decompress(self, payload: Payload, ctx: ScaledContext) -> torch.Tensor:
        scale, ternary = payload
        # QSGD's decoding with one level: scale * (t / 1), exactly scale * t.
        return qsgd_passes.decoded(ternary, scale, 1, ctx.work).to(ctx.dtype).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, torch.float32), (numel, torch.int8)]

    def __repr__(self) -> str:
        return f"TernGrad(seed={self.seed})"

    def recommended_memory(self) -> Memory:
        """``NoMemory``: unbiased for the clipped gradient; clipping is deliberate, not an error."""
        return NoMemory()
