"""What the 1-bit compressors (signSGD, Signum, EF-signSGD, 1-bit SGD) share: one bit per element,
``x >= 0``, packed 8 to a byte (``ceil(n / 8)`` bytes) beside each compressor's few scalars, gathered
without a header. ``+-0.0`` read as positive (a zero votes +1, decodes to ``+scale`` or joins the
non-negative side); ``NaN`` as negative, ``+-inf`` as its sign. EF-signSGD and 1-bit SGD carry a
non-finite value on in their scalars; signSGD and Signum send no magnitude, so only the bundle's
non-finite flags show an overflow. Gradients may be fp32, fp64, fp16 or bf16 (half-precision sums
and momenta accumulate in fp32); results have the gradient's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grace_legacy.compressors.kernels import sign_passes
from grace_legacy.runtime.validation import check_gradient

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class SignContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


def sign_context(tensor: torch.Tensor, owner: str) -> SignContext:
    check_gradient(tensor, owner)
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{owner}: gradients must be float32, float64, float16 or bfloat16, got {tensor.dtype}")
    return SignContext(tensor.shape, tensor.numel(), tensor.dtype, tensor.device)


def choose(packed: torch.Tensor, ctx: SignContext, if_set: torch.Tensor, if_clear: torch.Tensor) -> torch.Tensor:
    """The decoded tensor, in the gradient's shape and dtype: ``if_set`` where the packed bit is
    1 (``x >= 0``), ``if_clear`` where it is 0; both are scalars of that dtype."""
    return sign_passes.choose(packed, ctx.numel, if_set, if_clear).view(ctx.shape)
