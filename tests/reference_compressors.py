"""Independent references for the compressors GRACE's TensorFlow side has (AdaQ, INCEPTIONN,
SketchML's quantile buckets, 8-bit approximation) and BF16: each written from its documented
definition, sharing no code with ``grace_legacy``'s versions, and producing the same payload layout,
so that a test can hold the library to them bit for bit: the payloads, and every decoded value.

Each definition is written twice. ``compress_by_element`` / ``decompress_by_element`` is the
readable one, element by element in Python (exact fractions, Python floats, numpy scalars of the
work dtype); ``compress`` / ``decompress``, what the tests call on every tensor, is the same
definition as whole-array numpy formulas (``tests/reference_arrays.py``), which a Python loop over a
large tensor would not afford. ``tests/unit/test_reference_arrays.py`` holds the two to the same
payload bits and decoded values on drawn tensors.

They subclass ``grace_legacy.Compressor`` only to serve as the twins of the registry's reference
cases (``tests/registry.py``): the bundle calls ``compressor_for``, ``compress``, ``decompress`` and reads
the traits; everything they compute is their own. The generators are seeded from
``blake2b("seed\\0rank\\0name\\0step")``, written out here as the library documents it.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import numpy as np
import torch

from grace_legacy import Compressor, Residual
from grace_legacy.core.traits import Traits
from tests import reference_arrays as arrays


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _floats(tensor: torch.Tensor) -> list[float]:
    """The elements as Python floats (exact for every floating dtype)."""
    return tensor.detach().reshape(-1).double().tolist()


def _round(values: list[float] | float, dtype: torch.dtype) -> torch.Tensor:
    """Python floats rounded once to ``dtype``."""
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def _work(dtype: torch.dtype) -> type:
    return np.float64 if dtype == torch.float64 else np.float32


class _Reference(Compressor):
    """Per-tensor step counters of the references' own."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: dict[str, int] = {}

    def count(self, name: str) -> int:
        step = self.counted.get(name, 0)
        self.counted[name] = step + 1
        return step


class BF16Reference(_Reference):
    """A cast to bfloat16 (round to nearest even), summed by an allreduce, cast back."""

    traits = Traits(additive=True)

    def compress(self, tensor, name):
        return [tensor.detach().clone().to(torch.bfloat16)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        return payload[0].to(dtype).reshape(shape)

    def payload_spec(self, numel, dtype):
        return [(numel, torch.bfloat16)]


# -- 8-bit approximation ------------------------------------------------------------------------


def dynamic_tree_magnitudes() -> list[Fraction]:
    """The 128 magnitudes of Dettmers' dynamic tree type, by walking each 7-bit code: the zeros
    before the first one are the base-10 exponent, that one is the indicator, and each later bit
    keeps the upper (1) or lower (0) half of an interval that starts as [0.1, 1]; the code stands
    for the middle of the last interval. No indicator (all zeros): 0."""
    table = []
    for code in range(128):
        bits = [(code >> (6 - i)) & 1 for i in range(7)]
        if 1 not in bits:
            table.append(Fraction(0))
            continue
        zeros = bits.index(1)
        low, high = Fraction(1, 10), Fraction(1)
        for bit in bits[zeros + 1:]:
            middle = (low + high) / 2
            low, high = (middle, high) if bit else (low, middle)
        table.append((low + high) / 2 / 10**zeros)
    return table


class U8bitReference(_Reference):
    """Dettmers' 8-bit approximation: ``s = max |x|``; each element's byte is its sign (bit 7,
    ``x < 0``) and the code of the table magnitude nearest to ``|x| / s`` (computed in the work
    dtype, compared with the midpoints rounded to it, ties to the lower code); decoded
    ``sign T[c] s`` in the work dtype, rounded to the gradient's."""

    traits = Traits(delivers_nonfinite=True)

    def compress(self, tensor, name):
        table = dynamic_tree_magnitudes()
        midpoints = [(a + b) / 2 for a, b in zip(table, table[1:], strict=False)]
        scale, codes = arrays.u8bit_codes(arrays.float64s(tensor), _work(tensor.dtype), midpoints)
        return [_round([scale], tensor.dtype), torch.from_numpy(codes)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        scale, codes = payload
        values = arrays.u8bit_values(codes.cpu().numpy(), float(scale[0]), _work(dtype), dynamic_tree_magnitudes())
        return arrays.rounded(values, dtype).reshape(shape)

    def compress_by_element(self, tensor, name):
        values = _floats(tensor)
        work = _work(tensor.dtype)
        table = dynamic_tree_magnitudes()
        midpoints = [work(float((a + b) / 2)) for a, b in zip(table, table[1:], strict=False)]
        scale = max((abs(v) if not math.isnan(v) else math.nan for v in values),
                    key=lambda v: (math.isnan(v), v))
        codes = []
        with np.errstate(invalid="ignore", divide="ignore"):
            for v in values:
                ratio = work(abs(v)) / work(scale)
                code = 0 if not np.isfinite(ratio) else sum(1 for m in midpoints if m < ratio)
                codes.append(code | (128 if v < 0 else 0))
        return [_round([scale], tensor.dtype), torch.tensor(codes, dtype=torch.uint8)], (tensor.shape, tensor.dtype)

    def decompress_by_element(self, payload, ctx):
        shape, dtype = ctx
        scale, codes = payload
        work = _work(dtype)
        table = [work(float(t)) for t in dynamic_tree_magnitudes()]
        s = work(float(scale[0]))
        out = []
        with np.errstate(invalid="ignore", over="ignore"):
            for byte in codes.tolist():
                magnitude = table[byte & 127] * s
                out.append(float(-magnitude if byte & 128 else magnitude))
        return _round(out, dtype).reshape(shape)

    def payload_spec(self, numel, dtype):
        return [(1, dtype), (numel, torch.uint8)]

    def recommended_memory(self):
        return Residual()


# -- SketchML's quantile buckets ------------------------------------------------------------------


class SketchReference(_Reference):
    """Quantile buckets: splits at the sorted values of ranks ``floor(j n / q)``, bucket = how many
    splits are at or below the value (NaN read as +inf), each bucket's mean summed in float64 in
    element order; ``[means, uint8 buckets]``."""

    traits = Traits(delivers_nonfinite=True)

    def __init__(self, quantiles: int) -> None:
        super().__init__()
        self.quantiles = quantiles

    def compress(self, tensor, name):
        buckets, means = arrays.sketch_buckets(arrays.float64s(tensor), self.quantiles)
        return [arrays.rounded(means, tensor.dtype), torch.from_numpy(buckets)], (tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        shape, dtype = ctx
        means, buckets = payload
        return means[buckets.to(means.device).long()].reshape(shape)

    def compress_by_element(self, tensor, name):
        values = _floats(tensor)
        n, q = len(values), self.quantiles
        ordered = sorted(math.inf if math.isnan(v) else v for v in values)
        splits = [ordered[j * n // q] for j in range(1, q)]
        buckets = [sum(1 for s in splits if s <= (math.inf if math.isnan(v) else v)) for v in values]
        sums, counts = [0.0] * q, [0] * q
        for v, b in zip(values, buckets, strict=True):
            sums[b] += v
            counts[b] += 1
        means = [total / max(count, 1) for total, count in zip(sums, counts, strict=True)]
        return [_round(means, tensor.dtype), torch.tensor(buckets, dtype=torch.uint8)], (tensor.shape, tensor.dtype)

    def decompress_by_element(self, payload, ctx):
        shape, dtype = ctx
        means, buckets = payload
        return torch.stack([means[b] for b in buckets.tolist()]).reshape(shape)

    def payload_spec(self, numel, dtype):
        return [(self.quantiles, dtype), (numel, torch.uint8)]

    def recommended_memory(self):
        return Residual()


# -- INCEPTIONN ------------------------------------------------------------------------------------


class INCEPTIONNReference(_Reference):
    """INCEPTIONN's forms, decided from each value's binary exponent ``E`` (``|x|`` in ``[2**E,
    2**(E+1))``) against ``L`` (``2**L`` the largest power of two at or below the bound): full for
    ``|x| >= 1`` and non-finite values, dropped below the bound, 8 bits for ``E <= L + 6``, 16 bits
    for ``E <= L + 14``, else full; the bits are ``floor(|x| / 2**L)`` with the sign, by exact
    fractions. Tags four to a byte, the first lowest; ``[tags, full, int16, int8]``."""

    traits = Traits(uniform_payload=False, delivers_nonfinite=True)

    def __init__(self, error_bound: float) -> None:
        super().__init__()
        self.error_bound = error_bound
        level = 0
        while Fraction(2) ** (level + 1) <= Fraction(error_bound):
            level += 1
        while Fraction(2) ** level > Fraction(error_bound):
            level -= 1
        self.level = level

    def compress(self, tensor, name):
        values = arrays.float64s(tensor)
        tags, bits = arrays.inceptionn_forms(values, self.error_bound, self.level)
        full = np.flatnonzero(tags == arrays.FULL)
        flat = tensor.detach().reshape(-1)
        full_part = flat[torch.from_numpy(full).to(flat.device)] if len(full) else torch.empty(0, dtype=tensor.dtype)
        return [torch.from_numpy(arrays.pack_tags(tags)), full_part,
                torch.from_numpy(bits[tags == arrays.SIXTEEN].astype(np.int16)),
                torch.from_numpy(bits[tags == arrays.EIGHT].astype(np.int8))], (tensor.shape, tensor.dtype, len(values))

    def decompress(self, payload, ctx):
        shape, dtype, numel = ctx
        packed, full, q16, q8 = payload
        values = arrays.inceptionn_values(arrays.unpack_tags(packed.cpu().numpy(), numel), arrays.float64s(full),
                                          q16.cpu().numpy(), q8.cpu().numpy(), self.level)
        return arrays.rounded(values, dtype).reshape(shape)

    def compress_by_element(self, tensor, name):
        values = _floats(tensor)
        flat = tensor.detach().reshape(-1)
        tags, full, q16, q8 = [], [], [], []
        for i, v in enumerate(values):
            if not math.isfinite(v) or abs(v) >= 1:
                tags.append(3)
                full.append(flat[i])
                continue
            if abs(v) < self.error_bound:
                tags.append(0)
                continue
            exponent = math.frexp(abs(v))[1] - 1
            bits = math.floor(Fraction(abs(v)) / Fraction(2) ** self.level) * (-1 if v < 0 else 1)
            if exponent <= self.level + 6:
                tags.append(1)
                q8.append(bits)
            elif exponent <= self.level + 14:
                tags.append(2)
                q16.append(bits)
            else:
                tags.append(3)
                full.append(flat[i])
        packed = [0] * -(-len(tags) // 4)
        for i, tag in enumerate(tags):
            packed[i // 4] |= tag << (2 * (i % 4))
        full_part = torch.stack(full) if full else torch.empty(0, dtype=tensor.dtype)
        return [torch.tensor(packed, dtype=torch.uint8), full_part, torch.tensor(q16, dtype=torch.int16),
                torch.tensor(q8, dtype=torch.int8)], (tensor.shape, tensor.dtype, len(values))

    def decompress_by_element(self, payload, ctx):
        shape, dtype, numel = ctx
        packed, full, q16, q8 = payload
        tags = [(packed[i // 4].item() >> (2 * (i % 4))) & 3 for i in range(numel)]
        forms = {3: iter(full.tolist()), 2: iter(q16.tolist()), 1: iter(q8.tolist())}
        step = Fraction(2) ** self.level
        out = []
        for tag in tags:
            if tag == 0:
                out.append(0.0)
            elif tag == 3:
                out.append(next(forms[3]))
            else:
                out.append(float(next(forms[tag]) * step))
        return _round(out, dtype).reshape(shape)

    def recommended_memory(self):
        return Residual()


# -- AdaQ ------------------------------------------------------------------------------------------


class AdaQReference(_Reference):
    """Dryden et al.'s adaptive quantization, per sign: draw ``max(min_samples, ceil(sample_ratio
    n_s))`` of the side's entries with ``torch.randint`` from the step's generator (positive side
    first; all entries and no draw when that is not fewer than ``n_s``), threshold at the
    ``max(1, floor(ratio m))``-th largest sampled magnitude, send every entry of the side at or
    above it; decoded to the side's mean (a float64 sum in entry order). ``[i or -1-i, [mu+, mu-]]``."""

    traits = Traits(uniform_payload=False)

    def __init__(self, ratio: float, seed: int = 0, sample_ratio: float = 0.01, min_samples: int = 128) -> None:
        super().__init__()
        self.ratio, self.seed, self.sample_ratio, self.min_samples = ratio, seed, sample_ratio, min_samples

    def compress(self, tensor, name):
        values = arrays.float64s(tensor)
        generator = torch.Generator().manual_seed(_seed(self.seed, self.rank, name, self.count(name)))
        positive, mean_positive = arrays.adaq_side(values, True, self.sample_ratio, self.min_samples, self.ratio,
                                                   generator)
        negative, mean_negative = arrays.adaq_side(values, False, self.sample_ratio, self.min_samples, self.ratio,
                                                   generator)
        sent = np.concatenate([positive, -1 - negative])
        indices = torch.from_numpy(sent).to(torch.int32 if len(values) < 2**31 else torch.int64)
        means = _round([mean_positive, mean_negative], tensor.dtype)
        return [indices, means], (tensor.shape, tensor.dtype, len(values))

    def decompress(self, payload, ctx):
        shape, dtype, numel = ctx
        indices, means = payload
        sent = indices.cpu().long()
        out = torch.zeros(numel, dtype=dtype)
        out[sent[sent >= 0]] = means[0]
        out[-1 - sent[sent < 0]] = means[1]
        return out.reshape(shape)

    def compress_by_element(self, tensor, name):
        values = _floats(tensor)
        generator = torch.Generator().manual_seed(_seed(self.seed, self.rank, name, self.count(name)))
        sent, means = [], []
        for positive in (True, False):
            side = [i for i, v in enumerate(values) if (v > 0 if positive else v < 0)]
            chosen = []
            if side:
                samples = max(self.min_samples, math.ceil(Fraction(self.sample_ratio) * len(side)))
                pool = [abs(values[i]) for i in side]
                if samples < len(side):
                    pool = [pool[j] for j in torch.randint(0, len(side), (samples,), generator=generator).tolist()]
                k = max(1, math.floor(Fraction(repr(self.ratio)) * len(pool)))
                threshold = sorted(pool, reverse=True)[k - 1]
                chosen = [i for i in side if abs(values[i]) >= threshold]
            total = 0.0
            for i in chosen:
                total += values[i]
            means.append(total / max(len(chosen), 1))
            sent += chosen if positive else [-1 - i for i in chosen]
        indices = torch.tensor(sent, dtype=torch.int32 if len(values) < 2**31 else torch.int64)
        return [indices, _round(means, tensor.dtype)], (tensor.shape, tensor.dtype, len(values))

    def decompress_by_element(self, payload, ctx):
        shape, dtype, numel = ctx
        indices, means = payload
        out = torch.zeros(numel, dtype=dtype)
        for i in indices.tolist():
            out[i if i >= 0 else -1 - i] = means[0 if i >= 0 else 1]
        return out.reshape(shape)

    def recommended_memory(self):
        return Residual()


class ReferenceFamily:
    """The references of one compressor at each value of its scheduled parameter, the base of a
    ``tests.reference.RuleTwin``: ``with_value(v)`` is ``make(v)`` at this family's rank."""

    def __init__(self, make) -> None:
        self.make, self.rank = make, 0

    def set_rank(self, rank: int) -> None:
        self.rank = rank

    def with_value(self, value) -> Compressor:
        reference = self.make(value)
        reference.set_rank(self.rank)
        return reference


# -- holding a compressor to its reference ---------------------------------------------------------

#: The gradient dtypes every reference is held in.
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: Contents that reach every branch of the compressors above.
CONTENTS = ["normal", "zeros", "ties", "tiny", "wide", "nonfinite", "one"]


def awkward_gradient(content: str, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A gradient of ``numel`` elements in ``dtype``: normal draws, zeros, a few repeated values
    (ties), the dtype's subnormals and smallest normals, magnitudes from 1e-12 to 100, an inf, a
    NaN and a -inf among normal draws, or one element."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    if content == "zeros":
        x.zero_()
    elif content == "ties":
        x = torch.randint(-3, 4, (numel,), generator=g).double() / 4
    elif content == "tiny":
        x *= torch.finfo(dtype).tiny * 3
    elif content == "wide":
        x *= torch.pow(10.0, torch.randint(-12, 3, (numel,), generator=g).double())
    elif content == "nonfinite":
        x[[1, numel // 2, numel - 2]] = torch.tensor([math.inf, math.nan, -math.inf], dtype=torch.float64)
    elif content == "one":
        x = x[:1]
    return x.to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal dtype, shape and values, NaN where NaN (bit for bit but for NaN payloads)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual, expected)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


def assert_matches_reference(compressor: Compressor, reference: Compressor, content: str, dtype: torch.dtype,
                             label: str) -> None:
    """``compressor`` sends the payload ``reference`` sends and decodes it to the same values, part
    for part, for ranks 0 and 3 over two steps of a 7 x 43 gradient of ``content`` (one element
    for ``"one"``)."""
    for rank in (0, 3):
        compressor.set_rank(rank)
        reference.set_rank(rank)
        for step in range(2):
            x = awkward_gradient(content, 301, dtype, seed=10 * rank + step)
            x = x.view(7, 43) if content != "one" else x
            payload, ctx = compressor.compress(x, "layer.weight")
            expected, reference_ctx = reference.compress(x, "layer.weight")
            assert len(payload) == len(expected)
            for i, (part, part_expected) in enumerate(zip(payload, expected, strict=True)):
                assert_same(part, part_expected, f"{label} rank {rank} step {step}: payload part {i}")
            decoded = compressor.decompress(payload, ctx)
            assert_same(decoded, reference.decompress(expected, reference_ctx), f"{label}: decoded")
            assert decoded.shape == x.shape and decoded.dtype == dtype
