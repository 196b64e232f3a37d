"""SketchML's quantile-bucket quantification (Jiang et al., SIGMOD 2018): one byte per element, the
index of its quantile bucket, and each bucket's mean."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

from grace_legacy.compressors.quantization import work_dtype
from grace_legacy.core.compressor import Payload, Tunable
from grace_legacy.core.memory import Memory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime import paths
from grace_legacy.runtime.validation import check_gradient

#: The number of buckets: bucket indices travel as one byte, so at most 256.
QUANTILES = ScheduledParameter("quantiles", low=1, high=256, integer=True)

_INF = math.inf


class SketchContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


class Sketch(Tunable):
    """SketchML's quantile-bucket quantification (Jiang, Fu, Yang and Cui, "SketchML: Accelerating
    Distributed Machine Learning with Data Sketches", SIGMOD 2018; GRACE's ``sketch``).

    The ``n`` values are split into ``q = quantiles`` buckets of (nearly) equal counts by their
    quantiles, each value is sent as the index of its bucket, and each bucket is represented by
    the mean of its values. With ``v_(0) <= ... <= v_(n-1)`` the sorted values, the splits are

        s_j = v_(floor(j n / q)),   j = 1, ..., q - 1

    and ``x`` falls in bucket ``b(x) = #{j : s_j <= x}`` (so equal values share a bucket, and a
    bucket between equal splits stays empty). NaN counts as +inf in both the splits and the
    values. The bucket means ``m_b`` are summed in float64, in the order of the elements, divided by
    the bucket's count and rounded once to the gradient's dtype (0 for an empty bucket). Decoded:
    ``D(x)_i = m_{b(x_i)}``; every bucket keeps its sum, so ``sum_i D(x)_i = sum_i x_i`` up to that
    rounding. An inf or NaN makes its bucket's mean inf or NaN, which reaches every rank.

    Payload ``[means, indices]``: ``q`` means in the gradient's dtype and ``n`` uint8 indices, the
    same sizes on every rank: ``n`` bytes plus ``q`` values, padded to 8. Gathered (each rank has
    its own buckets), aggregated as the mean of the decoded tensors. Scheduled parameter: ``quantiles`` (an
    integer in [1, 256]; fewer buckets, coarser values, the same bytes per element).
    Recommended memory: :class:`~grace_legacy.memories.Residual` (a bucket mean is biased for
    each of its elements).

    Differences from the paper and from GRACE: SketchML finds its splits with a quantile sketch
    (a one-pass approximation) and further compresses sparse gradients' bucket indices with a
    MinMaxSketch and their keys with delta-binary encoding; here the gradient is dense and held in
    memory, so the splits are the exact quantiles (a sketch's limit) and the indices go as they
    are, which is what GRACE's TensorFlow ``sketch`` sends too. GRACE interpolates between order
    statistics for its splits (``tfp.stats.quantiles``) and allows more than 256 buckets with
    uint16 indices; this one splits at order statistics, so every split is a value of the tensor,
    and keeps the paper's one byte per index.
    """

    parameter = QUANTILES
    traits = Traits(delivers_nonfinite=True)

    def __init__(self, quantiles: int | None = None) -> None:
        super().__init__()
        self._set_value(quantiles)

    @property
    def quantiles(self) -> int | None:
        return self.value

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "Sketch")
        self.check_ready()
        flat = tensor.reshape(-1)
        numel, q = flat.numel(), self.quantiles
        work = flat.to(work_dtype(tensor.dtype))  # exact; numpy has no bfloat16
        values = torch.where(torch.isnan(work), torch.full((), _INF, dtype=work.dtype, device=work.device), work)
        if paths.cpu_path(values):  # numpy's sort is several times faster than torch's there
            ordered = torch.from_numpy(np.sort(values.numpy()))
        else:
            ordered = torch.sort(values).values
        at = torch.tensor([j * numel // q for j in range(1, q)], dtype=torch.int64, device=flat.device)
        buckets = torch.searchsorted(ordered.index_select(0, at), values, right=True)
        sums = torch.bincount(buckets, weights=flat.double(), minlength=q)
        counts = torch.bincount(buckets, minlength=q).clamp_(min=1)
        means = (sums / counts).to(tensor.dtype)
        return [means, buckets.to(torch.uint8)], SketchContext(tensor.shape, numel, tensor.dtype, tensor.device)

    def decompress(self, payload: Payload, ctx: SketchContext) -> torch.Tensor:
        means, buckets = payload
        return means.index_select(0, buckets.long()).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(self.quantiles, dtype), (numel, torch.uint8)]

    def recommended_memory(self) -> Memory:
        return Residual()
