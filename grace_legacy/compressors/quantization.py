"""What the unbiased stochastic quantizers (QSGD, TernGrad, natural compression) share.

Each one rounds every element at random to one of two neighbouring points of a coarse grid, with
the probabilities that make the expected value the input, so the compressed gradient is an
unbiased estimate and needs no error feedback (their recommended memory is ``NoMemory``).

Shared conventions:

* The draws are :func:`~grace_legacy.compressors.kernels.draws.uniform` of the key
  ``derived_seed(seed, rank, name, step)``: every rank draws its own numbers, the global RNG is
  never touched, every device draws the same numbers, and a test can replay any rank.
* On a CPU each quantizer is one compiled pass (:mod:`~grace_legacy.compressors.kernels.stochastic`)
  after its scale is known; elsewhere it is tensor arithmetic. Both give the same codes for the
  same scale (tested). QSGD's norm sums its squares in a fixed order on a CPU and in the device's
  own order elsewhere, so the two may differ in its last float32 bit. Each quantizer reads its
  scale back to the host once per tensor (on a GPU, one synchronization), to choose its path.
* Arithmetic runs in float64 for float64 gradients and in float32 for float32, float16 and bfloat16
  ones (which float32 holds exactly); ``decompress`` returns the gradient's own dtype, so a
  decoded value is finally rounded to it (for float16, one beyond 65504 becomes inf, as with
  ``FP16``).
* QSGD and TernGrad send their scale as float32, rounded *up* from the exact one, so a
  probability never exceeds 1 and the estimate stays unbiased with respect to the scale actually
  sent. A gradient that holds inf or NaN, or whose scale exceeds float32's range (about 3.4e38),
  decodes to NaN everywhere, so a loss scaler still sees the overflow. Natural compression marks
  such elements one by one (see :class:`~grace_legacy.compressors.natural.Natural`).
* Unbiasedness holds up to the resolution of the uniform draws (2**-24 in float32, 2**-53 in
  float64) and the rounding of one division per element.
* Payloads differ between ranks (each has its own scale), so they are gathered; every part's size
  is a function of the element count alone, so the gather needs no size header. The per-tensor
  scalar comes first in the payload, so the packed buffer is its size plus the elements' bytes,
  rounded up to a multiple of 8, with no padding in between."""

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
