"""Independent references for the LEGACY reference's own compressors (whole-model Top-k, CAT,
AdaComp, variance-based sparsification), written from their papers' definitions entry by entry in
Python (Python floats, numpy scalars of the work dtype: float32 for 16-bit and 32-bit gradients,
float64 for float64), sharing no code with ``grace_legacy``'s, and producing the same payload
layout (``[values, increasing int32 indices]``), so a test can hold the library to them bit for
bit. As in :mod:`tests.reference_compressors`, they subclass ``Compressor`` only to serve as twins.

Their order of entries, where one is needed: NaN first, then larger magnitude, then lower position
(the library's documented tie rule). A whole-model reference is given the step's gradients laid end
to end by the test (in the order of their names, as the library documents).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from grace_legacy import NoMemory, Residual
from grace_legacy.core.traits import Traits
from tests.reference_compressors import _floats, _Reference, _round, _work


def _by_magnitude(values: list[float]) -> list[int]:
    """Positions, NaN first, then by decreasing magnitude, ties by position: the order of
    ``sorted(range(n), key=lambda i: (not isnan(v[i]), 0 if isnan(v[i]) else -|v[i]|, i))``, by
    numpy's lexicographic sort (last key first) over the same three keys, exact on Python floats."""
    array = np.asarray(values, dtype=np.float64)
    nan = np.isnan(array)
    return np.lexsort((np.arange(array.size), np.where(nan, 0.0, -np.abs(array)), ~nan)).tolist()


def _in_work(values: list[float], work: type) -> list:
    """Each value rounded once to the work dtype, as numpy scalars of it: ``[work(v) for v in
    values]``, converted by numpy in one call."""
    return list(np.array(values, dtype=work))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


class _Entries(_Reference):
    """A payload of some entries of the input (or of a state's sums): ``[values, indices]``."""

    @staticmethod
    def _payload(values: list, chosen: list[int], tensor: torch.Tensor):
        ctx = (tensor.shape, tensor.dtype, tensor.numel())
        return [_round(values, tensor.dtype).reshape(-1), torch.tensor(chosen, dtype=_index_dtype(tensor.numel()))], ctx

    def support(self, payload, ctx):
        return payload[1].long()

    def decompress(self, payload, ctx):
        shape, dtype, numel = ctx
        out = torch.zeros(numel, dtype=dtype)
        out[payload[1].long()] = payload[0].to(dtype)  # the positions are distinct: each written once
        return out.reshape(shape)


class GlobalTopKReference(_Entries):
    """The first ``k = max(1, floor(ratio * n))`` entries by magnitude (``ratio`` read as the
    decimal written), sent as they are."""

    traits = Traits(delivers_nonfinite=True, sends_entries=True)

    def __init__(self, ratio: float) -> None:
        super().__init__()
        self.ratio = ratio

    def compress(self, tensor, name):
        values = _floats(tensor)
        k = max(1, math.floor(Fraction(repr(float(self.ratio))) * len(values)))
        chosen = sorted(_by_magnitude(values)[:k])
        return self._payload([values[i] for i in chosen], chosen, tensor)

    def payload_spec(self, numel, dtype):
        k = max(1, math.floor(Fraction(repr(float(self.ratio))) * numel))
        return [(k, dtype), (k, _index_dtype(numel))]

    def recommended_memory(self):
        return Residual()


class CATReference(_Entries):
    """Khirirat et al.'s CAT with the packet model: ``b`` bits an entry (value and index as sent),
    ``tau = max(1, packet_bits // b)`` entries a packet, ``T_m = min(m tau, n)``; ``m`` the first
    maximiser over every ``m`` of ``S(T_m) / (c0 m + c1)``, ``S`` the float64 running sum of the
    squares in magnitude order (a NaN ratio counts as the largest)."""

    traits = Traits(uniform_payload=False, delivers_nonfinite=True, sends_entries=True)

    def __init__(self, c0: float = 1.0, c1: float = 60.0, packet_bits: int = 1460) -> None:
        super().__init__()
        self.c0, self.c1, self.packet_bits = float(c0), float(c1), packet_bits

    def compress(self, tensor, name):
        values = _floats(tensor)
        n = len(values)
        bits = 8 * (tensor.element_size() + _index_dtype(n).itemsize)
        tau = max(1, self.packet_bits // bits)
        order = _by_magnitude(values)
        sums, total = [], 0.0
        for i in order:
            total += values[i] * values[i]
            sums.append(total)
        best, best_ratio = 1, None
        for m in range(1, -(-n // tau) + 1):
            ratio = sums[min(m * tau, n) - 1] / (self.c0 * m + self.c1)
            if best_ratio is None or (not math.isnan(best_ratio) and (math.isnan(ratio) or ratio > best_ratio)):
                best, best_ratio = m, ratio
        chosen = sorted(order[:min(best * tau, n)])
        return self._payload([values[i] for i in chosen], chosen, tensor)

    def recommended_memory(self):
        return Residual()


class AdaCompReference(_Entries):
    """Chen et al.'s AdaComp with exact values: per name a residue ``R``; ``G = R + g``,
    ``H = G + g`` in the work dtype; bins of ``bin_size`` consecutive entries; sent where
    ``|H_i| >= max_bin |G_j|`` (nothing in a bin holding a NaN ``G``), as ``G_i`` rounded to the
    gradient's dtype, leaving ``G_i`` minus that value in the residue; ``G_i`` stays elsewhere."""

    traits = Traits(uniform_payload=False)

    def __init__(self, bin_size: int) -> None:
        super().__init__()
        self.bin_size = bin_size
        self.residues: dict[str, list] = {}

    def compress(self, tensor, name):
        work = _work(tensor.dtype)
        grads = _in_work(_floats(tensor), work)
        residue = self.residues.get(name, [work(0.0)] * len(grads))
        g = [r + x for r, x in zip(residue, grads, strict=True)]
        chosen, kept = [], list(g)
        with np.errstate(invalid="ignore", over="ignore"):
            for first in range(0, len(g), self.bin_size):
                span = range(first, min(len(g), first + self.bin_size))
                magnitudes = [abs(g[i]) for i in span]
                if any(m != m for m in magnitudes):  # NaN is the one value unequal to itself
                    continue
                top = max(magnitudes)
                chosen += [i for i in span if abs(g[i] + grads[i]) >= top]
            sent = [float(g[i]) for i in chosen]
            rounded = _round(sent, tensor.dtype).tolist() if sent else []
            for i, value in zip(chosen, rounded, strict=True):
                kept[i] = g[i] - work(value)
        self.residues[name] = kept
        return self._payload(sent, chosen, tensor)

    def recommended_memory(self):
        return NoMemory()


class VarianceReference(_Entries):
    """Tsuzuku et al.'s test with exact values: per name ``r`` and ``v``; ``r' = r + g``,
    ``v' = v + m`` in the work dtype (``m`` from ``moment(name, gradient)``); sent where
    ``r'^2 > alpha v'`` (``alpha`` rounded to the work dtype), as ``r'`` rounded to the gradient's
    dtype, leaving ``r'`` minus that value and ``v = 0``; elsewhere ``r = r'``, ``v = ksi v'``."""

    traits = Traits(uniform_payload=False)

    def __init__(self, alpha: float, ksi: float, moment) -> None:
        super().__init__()
        self.alpha, self.ksi, self.moment = alpha, ksi, moment
        self.sums: dict[str, list] = {}
        self.variances: dict[str, list] = {}

    def compress(self, tensor, name):
        work = _work(tensor.dtype)
        grads = _in_work(_floats(tensor), work)
        moments = _in_work(_floats(self.moment(name, tensor)), work)
        r = self.sums.get(name, [work(0.0)] * len(grads))
        v = self.variances.get(name, [work(0.0)] * len(grads))
        alpha, ksi = work(self.alpha), work(self.ksi)
        chosen, next_r, next_v = [], [], []
        with np.errstate(invalid="ignore", over="ignore"):
            for i, (x, m) in enumerate(zip(grads, moments, strict=True)):
                total, noise = r[i] + x, v[i] + m
                if total * total > alpha * noise:
                    chosen.append(i)
                    next_v.append(work(0.0))
                else:
                    next_v.append(ksi * noise)
                next_r.append(total)
            sent = [float(next_r[i]) for i in chosen]
            rounded = _round(sent, tensor.dtype).tolist() if sent else []
            for i, value in zip(chosen, rounded, strict=True):
                next_r[i] = next_r[i] - work(value)
        self.sums[name], self.variances[name] = next_r, next_v
        return self._payload(sent, chosen, tensor)

    def recommended_memory(self):
        return NoMemory()


def squared_gradient(name: str, gradient: torch.Tensor) -> torch.Tensor:
    """The per-sample second moment of a batch of one sample: the squared gradient, in the work
    dtype (the moment the registry's variance cases use; the hooks' own are checked elsewhere)."""
    work = torch.float64 if gradient.dtype == torch.float64 else torch.float32
    return gradient.detach().to(work).square()


class SquaredGradients:
    """A moment source for ``VarianceSparsifier.attach`` giving :func:`squared_gradient`."""

    def take(self, name: str, gradient: torch.Tensor) -> torch.Tensor:
        return squared_gradient(name, gradient)

    def clear(self) -> None:
        pass
