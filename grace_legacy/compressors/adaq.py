"""Adaptive quantization (Dryden et al., 2016): per sign, the entries above a sampled threshold, sent
as their indices, all decoded to one mean per sign."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import torch

from grace_legacy.compressors.entries import DENSITY, kept_count
from grace_legacy.compressors.quantization import check_seed
from grace_legacy.compressors.sparse import index_dtype
from grace_legacy.core.compressor import Payload, Randomized, Tunable
from grace_legacy.core.memory import Memory
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import ArgumentTypeError, check_gradient


class AdaQContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


class AdaQ(Randomized, Tunable):
    """Adaptive quantization (Dryden, Moon, Jacobs and Van Essen, "Communication Quantization for
    Data-Parallel Training of Deep Neural Networks", MLHPC 2016; GRACE's ``adaq``), meant to run
    with error feedback.

    The positive and the negative entries are quantized apart. For each sign, of its ``n_s``
    entries:

    1. Draw ``m = max(min_samples, ceil(sample_ratio * n_s))`` of them uniformly, with replacement,
       from :meth:`generator` seeded by ``(seed, rank, name, step)`` (the positive side's draw
       first, then the negative side's); when ``m >= n_s``, take all ``n_s`` instead, and draw
       nothing.
    2. The threshold ``tau_s`` is the ``k``-th largest magnitude among them, ``k = max(1,
       floor(ratio * m))``, so about a ``ratio`` share of the side's entries lie at or above it
       (exactly the ``k`` largest, ties included, when all were taken).
    3. The entries ``S_s = {i : sign(x_i) = s, |x_i| >= tau_s}`` are sent, and decode to their mean
       ``mu_s = mean{x_i : i in S_s}`` (summed in float64 in the order of the entries, divided,
       rounded once to the gradient's dtype); every other entry decodes to 0.

    So ``sum_i D(x)_i = sum_i x_i`` over the sent entries, and :class:`~grace_legacy.memories.Residual`
    (the recommended memory, as in the paper) keeps what the means and the unsent entries left
    out. Zeros and NaN belong to neither side and are never sent.

    Payload ``[indices, means]``: the flat index ``i`` of each positive entry sent and ``-1 - i``
    (its bitwise complement) of each negative one, as the paper packs a sign with each index,
    int32 (int64 from 2**31 elements on), positives first, each side in increasing order; then
    ``[mu_+, mu_-]`` in the gradient's dtype (0 for a side with no entry). About ``4 ratio n``
    bytes; the size depends on the data (``uniform_payload = False``: a size header in the gather,
    and no dense fallback). Gathered, aggregated as the mean of the decoded tensors. Parameter:
    ``ratio``, the share of each side's entries to send, in (0, 1]; 1.0 sends the tensor dense,
    as every density does.

    GRACE's TensorFlow version samples 1% of each side, takes the ``ceil(0.01 ratio n_s)``-th
    largest sampled magnitude, then scales the threshold by 1.25 or 0.9 up to 20 times until the
    count selected is within [0.8, 1.25] of ``ceil(ratio n_s)``, and selects strictly above it.
    That correction loop is GRACE's, not the paper's, which estimates the thresholds from a
    sample once; this one does that, with the sample's size set like :class:`~grace_legacy.DGC`'s.
    """

    parameter = DENSITY
    traits = Traits(uniform_payload=False)

    def __init__(self, ratio: float | None = None, *, seed: int = 0, sample_ratio: float = 0.01,
                 min_samples: int = 128) -> None:
        super().__init__()
        self._set_value(ratio)
        self.seed = check_seed(seed, "AdaQ")
        for argument, value in (("sample_ratio", sample_ratio), ("min_samples", min_samples)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ArgumentTypeError(f"AdaQ: {argument} must be a number, got {value!r} of type "
                                        f"{type(value).__name__}")
        if not 0 < sample_ratio <= 1:
            raise ValueError(f"AdaQ: sample_ratio must be a number in (0, 1], got {sample_ratio!r}")
        if not isinstance(min_samples, numbers.Integral) or min_samples < 1:
            raise ValueError(f"AdaQ: min_samples must be an integer >= 1, got {min_samples!r}")
        self.sample_ratio = float(sample_ratio)
        self.min_samples = int(min_samples)

    @property
    def ratio(self) -> float | None:
        return self.value

    def sample_size(self, count: int) -> int:
        """How many of a side's ``count`` entries are sampled (all of them when it is at least ``count``)."""
        return max(self.min_samples, math.ceil(self.sample_ratio * count))

    def threshold(self, magnitudes: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``tau_s`` for one side, given the magnitudes of its entries (at least one)."""
        count = magnitudes.numel()
        samples = self.sample_size(count)
        if samples < count:
            drawn = torch.randint(0, count, (samples,), generator=generator)
            magnitudes = magnitudes.index_select(0, drawn.to(magnitudes.device))
        k = kept_count(self.ratio, magnitudes.numel())
        return torch.topk(magnitudes, k, sorted=False).values.min()

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "AdaQ")
        self.check_ready()
        step = self.next_step(name)
        flat = tensor.reshape(-1)
        generator = self.generator(self.seed, name, step)
        sent = []
        for side in (flat > 0, flat < 0):
            positions = side.nonzero().view(-1)
            if positions.numel():
                magnitudes = flat.index_select(0, positions).abs()
                positions = positions[magnitudes >= self.threshold(magnitudes, generator)]
            sent.append(positions)
        positive, negative = sent
        # One sum per side, in float64, each in the order of its entries (bincount adds them in turn).
        sides = torch.cat([torch.zeros_like(positive), torch.ones_like(negative)])
        values = flat.index_select(0, torch.cat(sent)).double()
        sums = torch.bincount(sides, weights=values, minlength=2)
        means = (sums / torch.bincount(sides, minlength=2).clamp_(min=1)).to(tensor.dtype)
        indices = torch.cat([positive, -1 - negative]).to(index_dtype(flat.numel()))
        return [indices, means], AdaQContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)

    def decompress(self, payload: Payload, ctx: AdaQContext) -> torch.Tensor:
        indices, means = payload
        negative = indices < 0
        out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=indices.device)
        out[indices[~negative].long()] = means[0]
        out[(-1 - indices[negative]).long()] = means[1]
        return out.view(ctx.shape)

    def recommended_memory(self) -> Memory:
        return Residual()

    def __repr__(self) -> str:
        return (f"AdaQ(ratio={self.ratio!r}, seed={self.seed}, sample_ratio={self.sample_ratio!r}, "
                f"min_samples={self.min_samples})")
