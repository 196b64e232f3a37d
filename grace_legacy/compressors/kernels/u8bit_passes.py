"""U8bit's passes (:class:`~grace_legacy.U8bit`): each element's byte, and the bytes decoded.

Code ``c`` of ``x_i`` is the number of midpoints between consecutive table magnitudes lying
strictly below ``|x_i| / s`` (so a ratio on a midpoint goes to the smaller magnitude), with
bit 7 set for ``x_i < 0``; a ratio that is not finite (``0 / 0``, an inf or NaN scale) gives 0.
Decoded: ``T[c & 127] * s``, negated where bit 7 is set. Both are written twice: the torch
formulas (:func:`codes_reference`, :func:`decoded_reference`, which every device other than the
CPU runs) and loops compiled by numba with the same float operations, so the two give the same
bits; :func:`codes` and :func:`decoded` pick one (docs/DESIGN.md#compiled-passes). torch's
``searchsorted`` takes a branchy binary search per element; the loop's search over the 127
midpoints (padded with +inf to 128) is seven steps without a branch.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled

BLOCK = compiled.BLOCK
#: Bits after the sign: 7, so 128 magnitudes.
MAGNITUDE_BITS = 7
SIGN_BIT = 1 << MAGNITUDE_BITS
#: The dtypes the loops take; the others (fp16, bf16) are worked in float32 by the reference.
_LOOP_DTYPES = (torch.float32, torch.float64)


def codes_reference(flat: torch.Tensor, scale: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """The uint8 codes of 1-D ``flat`` for the 0-D ``scale``, with ``midpoints`` (the 127 midpoints in
    the work dtype of ``flat``), by tensor arithmetic on ``flat``'s device."""
    work = midpoints.dtype
    ratio = flat.abs().to(work) / scale.to(work)
    ratio = torch.where(torch.isfinite(ratio), ratio, torch.zeros((), dtype=work, device=flat.device))
    codes = torch.searchsorted(midpoints, ratio).to(torch.uint8)
    return codes | ((flat < 0).to(torch.uint8) << MAGNITUDE_BITS)


def codes(flat: torch.Tensor, scale: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """:func:`codes_reference`'s codes: the compiled loop on a CPU for float32 and float64, else the
    reference."""
    if not compiled.applies(flat, _LOOP_DTYPES) or midpoints.dtype != flat.dtype:
        return codes_reference(flat, scale, midpoints)
    if not 0 < abs(float(scale)) < float("inf"):  # every ratio is 0 or not finite: code 0, the sign kept
        return (flat < 0).to(torch.uint8) << MAGNITUDE_BITS
    x = flat.contiguous().numpy()
    padded = np.full(SIGN_BIT, np.inf, dtype=x.dtype)
    padded[: midpoints.numel()] = midpoints.numpy()
    out = torch.empty(x.size, dtype=torch.uint8)
    compiled.run(_codes, _codes_parallel, x.size, x, x.dtype.type(float(scale)), padded, out.numpy())
    return out


def decoded_reference(codes: torch.Tensor, scale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``T[c & 127] * s`` for each code, negated where bit 7 is set, in ``table``'s dtype."""
    magnitude = table[(codes & (SIGN_BIT - 1)).long()] * scale.to(table.dtype)
    return torch.where(codes >= SIGN_BIT, -magnitude, magnitude)


def decoded(codes: torch.Tensor, scale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """:func:`decoded_reference`: the compiled loop on a CPU for a float32 or float64 table, else the
    reference."""
    if not compiled.applies(codes) or table.dtype not in _LOOP_DTYPES or table.device != codes.device:
        return decoded_reference(codes, scale, table)
    values = table.numpy()
    out = torch.empty(codes.numel(), dtype=table.dtype)
    compiled.run(_decoded, _decoded_parallel, codes.numel(), codes.reshape(-1).numpy(), values,
                 values.dtype.type(float(scale)), out.numpy())
    return out


@compiled.loop
def _codes_range(x, scale, padded, out, start, end):  # pragma: no cover - compiled
    x, out = x[start:end], out[start:end]
    zero = x.dtype.type(0)
    for i in range(x.size):
        value = x[i]
        ratio = abs(value) / scale
        if not np.isfinite(ratio):
            ratio = zero
        # How many midpoints lie strictly below the ratio: a search of 128 entries in seven halvings,
        # each a comparison added, not a branch.
        position = 0
        half = 64
        while half:
            position += half * (padded[position + half - 1] < ratio)
            half >>= 1
        out[i] = np.uint8(position | (SIGN_BIT * (value < zero)))


@compiled.loop
def _codes(x, scale, padded, out):  # pragma: no cover - compiled
    _codes_range(x, scale, padded, out, 0, x.size)


@compiled.parallel_loop
def _codes_parallel(x, scale, padded, out):  # pragma: no cover - compiled
    for b in numba.prange((x.size + BLOCK - 1) // BLOCK):
        _codes_range(x, scale, padded, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))


@compiled.loop
def _decoded_range(codes, table, scale, out, start, end):  # pragma: no cover - compiled
    codes, out = codes[start:end], out[start:end]
    for i in range(out.size):
        code = codes[i]
        magnitude = table[code & (SIGN_BIT - 1)] * scale
        out[i] = -magnitude if code >= SIGN_BIT else magnitude


@compiled.loop
def _decoded(codes, table, scale, out):  # pragma: no cover - compiled
    _decoded_range(codes, table, scale, out, 0, codes.size)


@compiled.parallel_loop
def _decoded_parallel(codes, table, scale, out):  # pragma: no cover - compiled
    for b in numba.prange((codes.size + BLOCK - 1) // BLOCK):
        _decoded_range(codes, table, scale, out, b * BLOCK, min(codes.size, (b + 1) * BLOCK))
