"""8-bit approximation (Dettmers, 2015): a scale and one byte per element, the byte a sign and an
index into a fixed 128-entry non-uniform table (the dynamic tree data type)."""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Any, NamedTuple

import torch

from grace_legacy.compressors.kernels import u8bit_passes
from grace_legacy.compressors.kernels.u8bit_passes import MAGNITUDE_BITS
from grace_legacy.compressors.quantization import work_dtype
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import check_gradient


def dynamic_tree_table() -> list[Fraction]:
    """The 128 magnitudes of the dynamic tree data type, exactly, by code.

    Code 0 is 0. A code ``c >= 1`` has its highest set bit, the indicator, at position
    ``f = floor(log2 c)``; the ``z = 6 - f`` zero bits above it are the exponent (base 10), and the
    ``f`` bits below it, ``j = c - 2**f``, are the path of a binary tree that bisects ``[0.1, 1]``
    ``f`` times. The code stands for the middle of the interval the path ends in:

        T[c] = 10**-z * (0.1 + 0.9 * (2 j + 1) / 2**(f + 1))

    so T rises with c: 64 values in ``[0.1, 1]``, 32 in ``[0.01, 0.1]``, ... and one, ``5.5e-7``,
    in ``[1e-7, 1e-6]``."""
    table = [Fraction(0)]
    for code in range(1, 1 << MAGNITUDE_BITS):
        f = code.bit_length() - 1
        j = code - (1 << f)
        table.append(Fraction(1, 10 ** (MAGNITUDE_BITS - 1 - f))
                     * (Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * j + 1, 2 ** (f + 1))))
    return table


_TABLE = dynamic_tree_table()
#: Between consecutive magnitudes: a magnitude above ``_MIDPOINTS[c - 1]`` has a code of at least c.
_MIDPOINTS = [(low + high) / 2 for low, high in zip(_TABLE, _TABLE[1:], strict=False)]


@functools.lru_cache(maxsize=64)
def _as_float(which: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The table (``"table"``) or its midpoints (``"midpoints"``) in ``dtype``, read only. float()
    of a Fraction rounds correctly; float64 to float32 may then round a second time."""
    values = _TABLE if which == "table" else _MIDPOINTS
    return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device).to(dtype)


class U8bitContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


class U8bit(Compressor):
    """8-bit approximation of gradients (Dettmers, "8-Bit Approximations for Parallelism in Deep
    Learning", 2015; GRACE's ``u8bit``), with the paper's dynamic tree data type.

    With ``s = max_i |x_i|``, each element becomes one byte: its sign (bit 7, set for ``x < 0``)
    and the code ``c`` (bits 0-6) of the table magnitude nearest to ``|x_i| / s``, the table being
    :func:`dynamic_tree_table` (a base-10 exponent of 0 to 6 told by the zero bits before an
    indicator bit, then a linear binary tree over ``[0.1, 1]``). Decoded: ``sign * T[c] * s``.
    "Nearest" compares ``|x_i| / s`` (in float32, float64 for float64 gradients) with the midpoints
    between consecutive magnitudes, rounded to that precision; a tie goes to the smaller
    magnitude. So the largest element decodes to ``0.99297 s`` (the top of the tree) and every
    ``|x_i| <= 2.75e-7 s`` to 0; between ``0.1 s`` and ``s`` the relative error is at most 6.2%,
    and among the ``2**(6 - z)`` magnitudes of exponent ``z`` the error is at most half their
    spacing, ``0.9 * 10**-z * s / 2**(7 - z)``.

    Payload ``[s, codes]``: the scale in the gradient's dtype (exact) and ``n`` uint8 codes, the
    same sizes on every rank: ``n`` bytes plus the scale, padded to 8. Gathered (each rank has its
    own scale), aggregated as the mean of the decoded tensors. An inf or NaN makes ``s`` inf or NaN
    and so decodes every element to inf or NaN: the overflow reaches every rank. No scheduled parameter: the
    format has no parameter. Recommended memory: :class:`~grace_legacy.memories.Residual`, since
    rounding to the nearest magnitude is biased and drops everything below ``2.75e-7 s``.

    GRACE's TensorFlow version uses a table of 128 magnitudes from ``1.5e-6`` to ``0.9957`` that
    are neither these values nor the midpoints between them, with ``tfp.stats.find_bins`` (the bin
    below, not the nearest magnitude); this one follows the paper's construction instead.
    """

    traits = Traits(delivers_nonfinite=True)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "U8bit")
        flat = tensor.reshape(-1)
        scale = flat.abs().amax()  # NaN if any element is (amax propagates it)
        codes = u8bit_passes.codes(flat, scale, _as_float("midpoints", work_dtype(tensor.dtype), flat.device))
        return [scale.reshape(1), codes], U8bitContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)

    def decompress(self, payload: Payload, ctx: U8bitContext) -> torch.Tensor:
        scale, codes = payload
        table = _as_float("table", work_dtype(ctx.dtype), codes.device)
        return u8bit_passes.decoded(codes, scale, table).to(ctx.dtype).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, dtype), (numel, torch.uint8)]

    def recommended_memory(self) -> Memory:
        return Residual()
