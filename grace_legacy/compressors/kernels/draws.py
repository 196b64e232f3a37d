"""Uniform draws in [0, 1) that every device reproduces bit for bit: SplitMix64 over a counter
(why: docs/DESIGN.md#counter-based-draws).

Word ``j`` (from 0) of key ``k`` is ``mix(k + (j + 1) * GAMMA)``, the ``j``-th output of Steele,
Lea and Flood's SplitMix64 started at ``k``. A float64 draw ``i`` is the top 53 bits of word ``i``
over ``2**53``; float32 draws ``2j`` and ``2j + 1`` are bits 40-63 and 8-31 of word ``j`` over
``2**24``. Every draw is a multiple of its dtype's resolution and a pure function of ``(key, i)``.

Two forms of the same numbers: :func:`uniform`, tensor arithmetic on any device, and
:func:`draw_pair`, which a compiled loop calls for the draws of the element pair it is at.
"""

from __future__ import annotations

import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled

#: SplitMix64's increment: the odd integer nearest ``2**64`` over the golden ratio.
GAMMA = 0x9E3779B97F4A7C15
#: SplitMix64's two multipliers (Stafford's "Mix13" finalizer).
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

#: Per work dtype: how many bits make a draw.
DRAW_BITS = {torch.float32: 24, torch.float64: 53}
#: Per work dtype: how many draws each word makes.
DRAWS_PER_WORD = {torch.float32: 2, torch.float64: 1}


def _signed(word: int) -> int:
    """A 64-bit word as the int64 with the same bits."""
    word &= 2**64 - 1
    return word - 2**64 if word >= 2**63 else word


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` read as unsigned."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


# In int64, whose products and sums wrap modulo 2**64 exactly as unsigned words do.
def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX2)
    return z ^ _shift_right(z, 31)


def uniform(key: int, n: int, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Draws ``0 .. n - 1`` of ``key`` (any int, used modulo ``2**64``) as a 1-D tensor of
    ``dtype`` (float32 or float64) on ``device``."""
    if dtype not in DRAW_BITS:
        raise TypeError(f"uniform: dtype must be torch.float32 or torch.float64, got {dtype}")
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"uniform: key must be an int, got {key!r}")
    bits, per_word = DRAW_BITS[dtype], DRAWS_PER_WORD[dtype]
    counter = torch.arange(1, -(-n // per_word) + 1, dtype=torch.int64, device=device)
    words = _mix(counter * _signed(GAMMA) + _signed(key))
    if per_word == 1:
        draws = _shift_right(words, 64 - bits)
    else:
        low_half = _shift_right(words, 32 - bits) & ((1 << bits) - 1)
        draws = torch.stack([_shift_right(words, 64 - bits), low_half], dim=1).reshape(-1)[:n]
    return draws.to(dtype) * 2.0**-bits


def key_word(key: int) -> np.uint64:
    """``key`` (any int, used modulo ``2**64``) as the unsigned word the compiled loops take."""
    return np.uint64(key & (2**64 - 1))


_GAMMA, _MIX1, _MIX2 = np.uint64(GAMMA), np.uint64(MIX1), np.uint64(MIX2)


@compiled.inline
def _word(key, j):  # pragma: no cover - compiled
    z = key + (j + np.uint64(1)) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


@compiled.inline
def draw_pair(key, j, x):  # pragma: no cover - compiled
    """In compiled code: draws ``2j`` and ``2j + 1`` of ``key`` (a :func:`key_word`) in the dtype of
    array ``x``, float32 or float64, as :func:`uniform` makes them (their bits convert exactly)."""
    if compiled.is_single(x):
        w = _word(key, np.uint64(j))
        unit = x.dtype.type(2.0**-24)
        return (x.dtype.type(w >> np.uint64(40)) * unit,
                x.dtype.type((w >> np.uint64(8)) & np.uint64(0xFFFFFF)) * unit)
    unit = x.dtype.type(2.0**-53)
    return (x.dtype.type(_word(key, np.uint64(2 * j)) >> np.uint64(11)) * unit,
            x.dtype.type(_word(key, np.uint64(2 * j + 1)) >> np.uint64(11)) * unit)
