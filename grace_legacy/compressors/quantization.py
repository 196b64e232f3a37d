"""What the unbiased stochastic quantizers (QSGD, TernGrad, natural compression) share: each rounds
every element at random to one of two neighbouring grid points with the probabilities that make
the expected value the input (unbiased, so their recommended memory is ``NoMemory``).

* Draws: :func:`~grace_legacy.compressors.kernels.draws.uniform` of ``derived_seed(seed, rank,
  name, step)``. A CPU's compiled pass and the tensor formulas give the same codes for the same
  scale; QSGD's norm may differ between them in its last float32 bit. Each quantizer reads its
  scale back to the host once per tensor (on a GPU, one synchronization).
* Arithmetic in float64 for float64 gradients, else float32 (which holds float16 and bfloat16
  exactly); ``decompress`` rounds to the gradient's dtype (float16 beyond 65504 becomes inf).
* QSGD's and TernGrad's scale travels as float32 rounded *up*, so no probability exceeds 1 and the
  estimate is unbiased for the scale sent. A gradient holding inf or NaN, or whose scale exceeds
  float32's range, decodes to NaN everywhere, so a loss scaler sees the overflow (Natural marks
  such elements one by one).
* Unbiased up to the draws' resolution (2**-24 in float32, 2**-53 in float64) and one division's
  rounding per element. Payloads (the scalar, then the elements) are gathered without a header."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from grace_legacy.core.compressor import Compressor

_INF = float("inf")


def check_seed(seed: Any, owner: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{owner}: seed must be an int, got {seed!r}")
    return seed


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, float16 and bfloat16 are all exact in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def float32_at_least(value: float) -> float:
    """The least float32 at or above ``value`` (a Python float; inf beyond float32's range, inf and
    NaN as they are), so that every probability ``|x| / scale`` stays at most 1."""
    if math.isnan(value) or math.isinf(value):
        return value
    if value > FLOAT32_MAX:
        return _INF
    if value < -FLOAT32_MAX:
        return -FLOAT32_MAX
    rounded = np.float32(value)
    # Compared as Python floats: numpy would compare in float32, where the two are equal.
    return float(rounded) if float(rounded) >= value else float(np.nextafter(rounded, np.float32(_INF)))


def round_to(value: float, work: torch.dtype) -> float:
    """``value`` rounded to nearest in ``work`` (float32 or float64), as tensor arithmetic in
    ``work`` would give it (inf beyond float32's range)."""
    if work == torch.float64:
        return value
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def draw_key(compressor: Compressor, seed: int, name: str) -> int:
    """The key of this step's draws for tensor ``name``; counts the step."""
    return compressor.step_seed(seed, name, compressor.next_step(name))


def usable_scale(scale: float) -> bool:
    """Whether ``scale`` can divide: finite and positive (never NaN)."""
    return 0 < scale < _INF


class ScaledContext(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    work: torch.dtype


def scale_part(scale: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([scale], dtype=torch.float32, device=device)
