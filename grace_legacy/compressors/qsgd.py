"""QSGD: stochastic rounding to ``s`` levels of the norm (see :mod:`~grace_legacy.compressors.quantization`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from grace_legacy.compressors.kernels import qsgd_passes
from grace_legacy.compressors.quantization import (
    check_seed,
    draw_key,
    float32_at_least,
    scale_part,
    usable_scale,
    work_dtype,
)
from grace_legacy.core.compressor import Payload, Randomized, Tunable
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


class QSGDContext(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    work: torch.dtype
    levels: int


class QSGD(Randomized, Tunable):
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
        norm = float32_at_least(qsgd_passes.norm(x))
        if usable_scale(norm):
            signed = qsgd_passes.levels(x, norm, s, key, level_dtype(s))
        else:  # a zero tensor, or inf or NaN in it: decodes to zeros or NaN
            signed = torch.zeros(x.numel(), dtype=level_dtype(s), device=x.device)
        return [scale_part(norm, x.device), signed], QSGDContext(tensor.shape, tensor.dtype, work, s)

    def decompress(self, payload: Payload, ctx: QSGDContext) -> torch.Tensor:
        norm, signed = payload
        return qsgd_passes.decoded(signed, norm, ctx.levels, ctx.work).to(ctx.dtype).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, torch.float32), (numel, level_dtype(self.levels))]

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels!r}, seed={self.seed})"

    def recommended_memory(self) -> Memory:
        """``NoMemory``: the estimate is unbiased."""
        return NoMemory()
