"""The independent references of ``tests/reference_compressors.py`` as whole-array numpy formulas,
for tensors of any size (the zoo's 640,000-element one included): the same documented definitions,
the same payload bits and decoded values as the element-by-element versions there (which stay the
readable definitions; ``tests/unit/test_reference_arrays.py`` holds the two equal), sharing no
code with ``grace_legacy``.

Why each array formula computes exactly what the per-element one does:

* a count of sorted thresholds ``m < r`` (``m <= r``) is ``searchsorted(m, r, side="left")``
  (``"right"``), for nondecreasing ``m`` and no NaN among ``m`` or ``r``;
* a per-bucket float64 sum in element order is ``np.bincount(b, weights=v)``, whose loop adds
  ``v[i]`` to its bucket for ``i = 0, 1, ...`` in turn (a sequential sum, not numpy's pairwise
  ``sum``);
* scaling by a power of two (``np.ldexp``) is exact whenever the result is a float64 that holds the
  operand's significand, which each use below argues.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch


def float64s(tensor: torch.Tensor) -> np.ndarray:
    """The elements as float64 (exact for every floating dtype), on the CPU."""
    return tensor.detach().reshape(-1).double().cpu().numpy()


def rounded(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float64 values rounded once to ``dtype``."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64)).to(dtype)


def sequential_sum(values: np.ndarray) -> float:
    """``values`` summed in float64 in their order, one addition after another."""
    return float(np.bincount(np.zeros(len(values), dtype=np.intp), weights=values, minlength=1)[0])


# -- 8-bit approximation ------------------------------------------------------------------------


def u8bit_codes(values: np.ndarray, work: type, midpoints: list[Fraction]) -> tuple[float, np.ndarray]:
    """The scale (``max |x|``, NaN if any is NaN) and each element's byte: the number of
    ``midpoints`` (rounded to ``work``) strictly below ``|x| / s`` computed in ``work`` (0 when
    that is not finite), with bit 7 set for ``x < 0``."""
    edges = np.array([work(float(m)) for m in midpoints], dtype=work)
    assert bool(np.all(edges[1:] >= edges[:-1])), "the midpoints must be sorted for searchsorted"
    scale = float("nan") if bool(np.isnan(values).any()) else float(np.abs(values).max())
    with np.errstate(invalid="ignore", divide="ignore"):
        # float32 / float32 in numpy is the correctly rounded float32 quotient, as for its scalars.
        ratios = np.abs(values).astype(work) / work(scale)
    finite = np.isfinite(ratios)
    codes = np.zeros(len(values), dtype=np.int64)
    codes[finite] = np.searchsorted(edges, ratios[finite], side="left")
    codes |= np.where(values < 0, 128, 0)
    return scale, codes.astype(np.uint8)


def u8bit_values(codes: np.ndarray, scale: float, work: type, table: list[Fraction]) -> np.ndarray:
    """``sign T[c] s`` computed in ``work``, as float64."""
    magnitudes = np.array([work(float(t)) for t in table], dtype=work)
    with np.errstate(invalid="ignore", over="ignore"):
        out = magnitudes[codes & 127] * work(scale)
    return np.where(codes & 128 != 0, -out, out).astype(np.float64)


# -- SketchML's quantile buckets ------------------------------------------------------------------


def sketch_buckets(values: np.ndarray, quantiles: int) -> tuple[np.ndarray, np.ndarray]:
    """Each element's bucket (how many splits ``ordered[floor(j n / q)]`` are at or below it, NaN
    read as +inf) and each bucket's mean (a float64 sum in element order over the count, or 0)."""
    n = len(values)
    keys = np.where(np.isnan(values), np.inf, values)
    ordered = np.sort(keys, kind="stable")
    splits = ordered[[j * n // quantiles for j in range(1, quantiles)]]
    buckets = np.searchsorted(splits, keys, side="right")
    with np.errstate(invalid="ignore"):
        sums = np.bincount(buckets, weights=values, minlength=quantiles)
    counts = np.bincount(buckets, minlength=quantiles)
    with np.errstate(invalid="ignore"):
        means = sums / np.maximum(counts, 1)
    return buckets.astype(np.uint8), means


# -- INCEPTIONN ------------------------------------------------------------------------------------

#: INCEPTIONN's tags: dropped, 8 bits, 16 bits, full.
DROPPED, EIGHT, SIXTEEN, FULL = 0, 1, 2, 3


def inceptionn_forms(values: np.ndarray, error_bound: float, level: int) -> tuple[np.ndarray, np.ndarray]:
    """Each element's tag and, for the quantised ones (tags 1 and 2), the signed ``floor(|x| /
    2**L)``.

    Exactness: a quantised ``|x|`` lies in ``[bound, 2**(L+15))`` with ``bound >= 2**L``, so
    ``ldexp(|x|, -L)`` lies in ``[1, 2**15)``, a normal float64; ``|x|`` is an integer times
    ``2**e`` with at most 53 significant bits and the product only moves ``e``, so it is exact, and
    its floor is the floor of the exact fraction ``|x| / 2**L``."""
    magnitude = np.abs(values)
    exponent = np.frexp(magnitude)[1].astype(np.int64) - 1
    full = ~np.isfinite(values) | (magnitude >= 1)
    dropped = ~full & (magnitude < error_bound)
    tags = np.full(len(values), FULL, dtype=np.uint8)
    tags[dropped] = DROPPED
    tags[~full & ~dropped & (exponent <= level + 6)] = EIGHT
    tags[~full & ~dropped & (exponent > level + 6) & (exponent <= level + 14)] = SIXTEEN
    quantised = (tags == EIGHT) | (tags == SIXTEEN)
    bits = np.zeros(len(values), dtype=np.int64)
    bits[quantised] = np.floor(np.ldexp(magnitude[quantised], -level)).astype(np.int64)
    return tags, np.where(values < 0, -bits, bits)


def pack_tags(tags: np.ndarray) -> np.ndarray:
    """Four 2-bit tags to a byte, the first in the lowest bits."""
    padded = np.zeros(-(-len(tags) // 4) * 4, dtype=np.uint8)
    padded[:len(tags)] = tags
    return np.bitwise_or.reduce(padded.reshape(-1, 4) << np.array([0, 2, 4, 6], dtype=np.uint8), axis=1)


def unpack_tags(packed: np.ndarray, numel: int) -> np.ndarray:
    return ((packed[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(-1)[:numel]


def inceptionn_values(tags: np.ndarray, full: np.ndarray, q16: np.ndarray, q8: np.ndarray,
                      level: int) -> np.ndarray:
    """Decoded as float64: 0 where dropped, the full values, and ``bits 2**L``: exact, as ``|bits|
    < 2**15`` and ``L >= -1074`` make ``bits 2**L`` a float64 (normal or subnormal)."""
    out = np.zeros(len(tags), dtype=np.float64)
    out[tags == FULL] = full
    out[tags == SIXTEEN] = np.ldexp(q16.astype(np.float64), level)
    out[tags == EIGHT] = np.ldexp(q8.astype(np.float64), level)
    return out


# -- AdaQ ------------------------------------------------------------------------------------------


def adaq_side(values: np.ndarray, positive: bool, sample_ratio: float, min_samples: int, ratio: float,
              generator: torch.Generator) -> tuple[np.ndarray, float]:
    """One sign's entries at or above the threshold (the ``max(1, floor(ratio m))``-th largest of
    ``m`` sampled magnitudes, the draw made as in the definition) and their mean."""
    side = np.flatnonzero(values > 0 if positive else values < 0)
    if len(side) == 0:
        return side, 0.0
    samples = max(min_samples, -(-Fraction(sample_ratio) * len(side) // 1))
    pool = np.abs(values[side])
    if samples < len(side):
        pool = pool[torch.randint(0, len(side), (int(samples),), generator=generator).numpy()]
    k = max(1, int(Fraction(repr(ratio)) * len(pool) // 1))
    threshold = np.sort(pool)[len(pool) - k]
    chosen = side[np.abs(values[side]) >= threshold]
    return chosen, sequential_sum(values[chosen]) / max(len(chosen), 1)
