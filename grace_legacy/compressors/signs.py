"""What the 1-bit compressors (signSGD, Signum, EF-signSGD, 1-bit SGD) share: packed signs.

Every element travels as one bit, packed 8 to a byte (:mod:`grace_legacy.compressors.kernels.bits`):
``ceil(n / 8)`` bytes for ``n`` elements, plus each compressor's few scalars. None of the payloads
can be summed by an allreduce (a sum of packed bytes is not a sum of signs, and the scalars
differ per rank), so all four are gathered; their sizes depend only on ``n``, so
``uniform_payload`` holds and the gather carries no size header. On the wire (see
:mod:`grace_legacy.core.wire`) a tensor's buffer is padded to a multiple of 8 bytes.

The bit of an entry ``x`` is ``x >= 0``, in all four compressors:

* ``+0.0`` and ``-0.0`` read as positive (+1): one bit has no room for a third value. A gradient
  entry that is exactly zero on every rank therefore votes +1 in signSGD/Signum and moves its
  parameter by ``-lr``; EF-signSGD decodes it to ``+scale`` and its error feedback returns the
  difference at the next step; 1-bit SGD puts it on the non-negative side, whose mean it lowers.
* ``NaN`` reads as negative (``NaN >= 0`` is false) and ``+-inf`` as its sign. EF-signSGD and 1-bit
  SGD carry the non-finite value on in their scalars (the decoded tensor is then non-finite, as a
  dense allreduce would be), but signSGD and Signum send no magnitude and cannot: they hide an
  overflow from an AMP ``GradScaler``.

Gradients may be fp32, fp64, fp16 or bf16; sums and momenta of half-precision gradients are
accumulated in fp32. ``decompress`` and ``aggregate`` return the gradient's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from grace_legacy.compressors.kernels import sign_passes
from grace_legacy.compressors.kernels.bits import pack_bits, unpack_bits
from grace_legacy.core import paths
from grace_legacy.core.validation import check_gradient

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


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision gradients (an fp16 sum overflows at 65504), else the dtype itself."""
    return torch.promote_types(dtype, torch.float32)


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """The packed bits of ``tensor >= 0``: on a CPU in one compiled pass, without a bool tensor."""
    if sign_passes.kernels_apply(tensor):
        return sign_passes.pack_nonnegative(tensor)
    return pack_bits(tensor.reshape(-1) >= 0)


def choose(packed: torch.Tensor, ctx: SignContext, if_set: torch.Tensor, if_clear: torch.Tensor) -> torch.Tensor:
    """The decoded tensor, in the gradient's shape and dtype: ``if_set`` where the packed bit is
    1 (``x >= 0``), ``if_clear`` where it is 0; both are scalars of that dtype."""
    if sign_passes.kernels_apply(if_set) and paths.cpu_path(packed):
        return sign_passes.choose(packed, ctx.numel, if_set.item(), if_clear.item(), ctx.dtype).view(ctx.shape)
    return torch.where(unpack_bits(packed, ctx.numel), if_set, if_clear).view(ctx.shape)
