"""Exact Top-k selection by magnitude: a sampled threshold, one candidate pass, then an exact top-k
among the few candidates (why: docs/DESIGN.md#top-k-selection).

1. *Estimate.* Of ``s`` sampled positions, ``mu = k s / n`` are expected among the top k; the
   sample's ``r = ceil(mu + 3 sqrt(mu)) + 1``-th largest magnitude ``t`` lies about three standard
   deviations of that count below the k-th largest, so it rarely admits too few candidates while
   their number, about ``n r / s``, stays a small multiple of ``k``.
2. *Candidates.* ``C = {i : |x_i| >= t}`` in one pass.
3. *Exact.* If ``|C| >= k`` the top k all lie in ``C``; if ``|C| < k`` every member of ``C`` beats
   every non-member, so the top k are ``C`` and the ``k - |C|`` largest of the rest. Either way the
   result is the set ``torch.topk`` picks (ties aside), whatever ``t`` was. Where ``C`` holds more
   than half the entries, a plain top-k is used.

Magnitudes compare as the floats' bit patterns with the sign bit cleared (every NaN above infinity,
where ``torch.topk`` puts it); on a CPU with compiled passes, elsewhere in torch.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from grace_legacy.compressors.kernels.scan import candidates_at_or_above, entries_in_range, largest
from grace_legacy.runtime import paths

#: Below this many entries a plain ``torch.topk`` is as fast as anything (per-call overheads win).
SMALL = 1 << 15
#: Positions sampled for the estimate: the candidates stay a small multiple of ``k`` down to
#: density 0.001, at no cost next to one pass.
SAMPLES = 4096
#: Consecutive entries per sampled run (see :func:`_sample_positions`).
SAMPLE_RUN = 16
#: Standard deviations of the sampled count by which the estimate is set low.
MARGIN_SIGMAS = 3.0

#: float dtype -> (same-width integer dtype, mask clearing the sign bit)
_MAGNITUDE_BITS = {
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFF_FFFF),
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF),
}
#: float dtype -> the bit pattern of +inf (every NaN's magnitude bits are above it)
_INFINITY_BITS = {dtype: int(torch.tensor([float("inf")], dtype=dtype).view(int_dtype)[0])
                  for dtype, (int_dtype, _) in _MAGNITUDE_BITS.items()}
#: the index dtypes of a sparse payload, as numpy spells them
_NUMPY_INDEX = {torch.int32: np.int32, torch.int64: np.int64}


def estimate_order(k: int, samples: int, numel: int) -> int:
    """Which largest sampled magnitude (1-based) estimates the threshold (see the module doc)."""
    mu = k * samples / numel
    return math.ceil(mu + MARGIN_SIGMAS * math.sqrt(mu)) + 1


@functools.lru_cache(maxsize=512)
def _sample_positions(numel: int) -> np.ndarray:
    """Fixed pseudo-random positions for tensors of ``numel >= SAMPLE_RUN`` entries, a function of
    ``numel`` alone (deterministic, no global RNG), in runs of :data:`SAMPLE_RUN` consecutive
    entries at random places (docs/DESIGN.md#top-k-selection)."""
    starts = np.sort(np.random.default_rng(numel).integers(0, numel - SAMPLE_RUN + 1, SAMPLES // SAMPLE_RUN))
    positions = (starts[:, None] + np.arange(SAMPLE_RUN)).reshape(-1)
    positions.flags.writeable = False
    return positions


def _magnitude_bits(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``flat``'s bits as integers, and the mask that turns them into comparable magnitudes."""
    try:
        int_dtype, mask = _MAGNITUDE_BITS[flat.dtype]
    except KeyError:
        raise TypeError(f"top-k selection needs a floating tensor (fp16, bf16, fp32, fp64), got {flat.dtype}") from None
    return flat.detach().contiguous().view(int_dtype), mask


def top_k_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The flat indices (int64, in no particular order) of the ``k`` entries of the 1-D ``flat``
    with the largest magnitudes: the set ``torch.topk(flat.abs(), k)`` picks, ties aside, with NaN
    above infinity above every finite magnitude."""
    numel = flat.numel()
    if not 1 <= k <= numel:
        raise ValueError(f"top-k selection: k must be in [1, {numel}], got {k}")
    if numel < SMALL or 4 * k > numel:
        return _plain_top_k(flat, k)
    if paths.cpu_path(flat):
        bits, mask = _magnitude_bits(flat)
        sampled = np.bitwise_and(bits.numpy()[_sample_positions(numel)], mask)
        r = estimate_order(k, SAMPLES, numel)
        if r >= SAMPLES:
            return _plain_top_k(flat, k)
        threshold = np.partition(sampled, SAMPLES - r)[SAMPLES - r]
        return _select_cpu(flat, k, int(threshold), expected=numel * r // SAMPLES)
    return _top_k_indices_torch(flat, k)


def top_k_first(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The flat indices (int64, increasing) of the ``k`` entries of the 1-D ``flat`` with the largest
    magnitudes, ties at the k-th magnitude going to the lower index: the first ``k`` of a stable
    sort by magnitude, descending (NaN above infinity above every finite magnitude). A rule that
    depends on the values alone, so that an independent reference picks the same set. One pass
    more than :func:`top_k_indices`: every entry at or above the k-th magnitude it found."""
    kth = _kth_magnitude(flat, top_k_indices(flat, k))
    if paths.cpu_path(flat):
        bits, mask = _magnitude_bits(flat)
        positions, magnitudes = candidates_at_or_above(bits.numpy(), mask, kth, 2 * k)
        if positions.size > k:  # ties at the k-th magnitude: the first ones
            tied = magnitudes == kth
            keep = ~tied | (np.cumsum(tied) <= k - (positions.size - int(tied.sum())))
            positions = positions[keep]
        return torch.from_numpy(positions)
    bits, mask = _magnitude_bits(flat)
    magnitudes = bits.bitwise_and(mask)
    above = torch.nonzero(magnitudes > kth).reshape(-1)
    tied = torch.nonzero(magnitudes == kth).reshape(-1)[: k - above.numel()]
    return torch.cat([above, tied]).sort().values


def _kth_magnitude(flat: torch.Tensor, chosen: torch.Tensor) -> int:
    """The smallest magnitude bits among the entries of ``flat`` at ``chosen``."""
    bits, mask = _magnitude_bits(flat.index_select(0, chosen.to(flat.device)))
    return int(bits.bitwise_and(mask).min())


def _top_k_indices_torch(flat: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`top_k_indices` for a large ``flat`` (``k <= numel / 4``) in torch, on any device."""
    numel = flat.numel()
    if numel < SAMPLES or estimate_order(k, SAMPLES, numel) >= SAMPLES:
        return _plain_top_k(flat, k)
    r = estimate_order(k, SAMPLES, numel)
    magnitudes = flat.abs()
    sample = torch.tensor(_sample_positions(numel), device=flat.device)
    threshold = torch.topk(magnitudes[sample], r, sorted=False).values.min()
    return _select_torch(magnitudes, k, threshold)


def top_k_at_or_above(flat: torch.Tensor, k: int, threshold: float | torch.Tensor) -> torch.Tensor:
    """As :func:`top_k_indices`, with the threshold estimate given (for DGC, which draws its own
    sample): exact whatever ``threshold`` is, only the work depends on it."""
    numel = flat.numel()
    if not 1 <= k <= numel:
        raise ValueError(f"top-k selection: k must be in [1, {numel}], got {k}")
    if paths.cpu_path(flat):
        estimate = torch.as_tensor(threshold, dtype=flat.dtype).abs().reshape(1)
        bits, mask = _magnitude_bits(estimate)
        return _select_cpu(flat, k, int(bits.numpy()[0]) & mask, expected=2 * k)
    return _select_torch(flat.abs(), k, torch.as_tensor(threshold, device=flat.device))


def _plain_top_k(flat: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(flat.abs(), k, sorted=False).indices


def _select_cpu(flat: torch.Tensor, k: int, threshold_bits: int, expected: int) -> torch.Tensor:
    """Steps 2 and 3 of the module doc, on magnitude bits, on CPU (``expected``: about how many
    candidates the threshold admits, to size their array)."""
    bits, mask = _magnitude_bits(flat)
    bits = bits.numpy()
    found = candidates_at_or_above(bits, mask, threshold_bits, 2 * expected,
                                   limit=bits.size // 2)
    if found is None:  # more than half the entries: a plain top-k is cheaper
        return _plain_top_k(flat, k)
    candidates, magnitudes = found
    count = candidates.size
    if count > k:
        return torch.from_numpy(largest(candidates, magnitudes, k))
    if count == k:
        return torch.from_numpy(candidates)
    # Rare (the estimate was too high): a second, plain pass over everything for the rest.
    all_magnitudes = np.bitwise_and(bits, mask)
    rest = np.flatnonzero(all_magnitudes < threshold_bits)
    return torch.from_numpy(np.concatenate([candidates, largest(rest, all_magnitudes[rest], k - count)]))


@functools.lru_cache(maxsize=256)
def magnitude_bound(threshold: float, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """The smallest value of ``dtype`` that is ``>= threshold`` (a 0-dim tensor, possibly ``inf``),
    and its magnitude bits: ``|x| >= bound`` holds exactly when ``|x| >= threshold`` does, for
    every ``x`` of ``dtype`` (rounding to nearest would not: fp16's nearest to 0.1 is below it).
    Cached: a threshold stays for many steps."""
    exact = torch.tensor(threshold, dtype=torch.float64)
    bound = exact.to(dtype)
    if bound.to(torch.float64) < exact:
        bound = torch.nextafter(bound, torch.tensor(float("inf"), dtype=dtype))
    bits, mask = _magnitude_bits(bound.reshape(1))
    return bound, int(bits[0]) & mask


def entries_at_or_above(flat: torch.Tensor, threshold: float,
                        index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)``: the entries of the 1-D ``flat`` with magnitude ``>= threshold`` (exactly
    in ``flat``'s dtype, NaN never) and their increasing positions as ``index_dtype``: what
    ``i = torch.nonzero(flat.abs() >= threshold)`` and ``flat[i]`` give (those, below :data:`SMALL`)."""
    bound, bound_bits = magnitude_bound(threshold, flat.dtype)
    if not paths.cpu_path(flat) or flat.numel() < SMALL:
        positions = torch.nonzero(flat.abs() >= bound.to(flat.device)).reshape(-1)
        return flat.index_select(0, positions), positions.to(index_dtype)
    bits, mask = _magnitude_bits(flat)
    # NaN's patterns sort above infinity's, so the upper end of the range leaves them out.
    kept, positions = entries_in_range(bits.numpy(), mask, bound_bits, _INFINITY_BITS[flat.dtype],
                                       _NUMPY_INDEX[index_dtype])
    if not positions.size:  # numpy's empty array can carry a zero stride, which torch cannot view
        return flat.new_empty(0), torch.empty(0, dtype=index_dtype)
    return torch.from_numpy(kept).view(flat.dtype), torch.from_numpy(positions)


def _select_torch(magnitudes: torch.Tensor, k: int, threshold: torch.Tensor) -> torch.Tensor:
    """Steps 2 and 3 of the module doc in torch (any device), on the magnitudes ``|x|``."""
    # `~(m < t)` rather than `m >= t`: NaN is then a candidate, as it is largest for torch.topk.
    above = ~(magnitudes < threshold)
    candidates = torch.nonzero(above).reshape(-1)
    count = candidates.numel()
    if 2 * count > magnitudes.numel():
        return torch.topk(magnitudes, k, sorted=False).indices
    if count >= k:
        return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
    rest = torch.nonzero(~above).reshape(-1)
    extra = torch.topk(magnitudes[rest], k - count, sorted=False).indices
    return torch.cat([candidates, rest[extra]])
