"""Deep Gradient Compression's selection (Lin et al., ICLR 2018): top-k by a sampled threshold."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from grace_legacy.compressors.entries import kept_count
from grace_legacy.compressors.kernels import selection
from grace_legacy.compressors.kernels.selection import top_k_at_or_above
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.compressors.topk import TopK
from grace_legacy.core.compressor import Payload, Randomized
from grace_legacy.core.memory import Memory
from grace_legacy.memories.dgc import DGCMemory
from grace_legacy.runtime.validation import ArgumentTypeError, check_gradient


class DGC(Randomized, TopK):
    """Deep Gradient Compression's sparsifier (Lin et al., 2018): the entries :class:`TopK` keeps
    (with its payload and dtypes), found the DGC way: ``s = max(min_samples, ceil(sample_ratio * n))``
    positions drawn uniformly with replacement (keyed by ``(seed, rank, name, step)``), the sample's
    ``r = ceil(mu + 3 sqrt(mu)) + 1``-th largest magnitude as the threshold (``mu = k s / n``), then
    an exact selection among the entries at or above it
    (:mod:`~grace_legacy.compressors.kernels.selection`); a plain ``torch.topk`` where ``s >= n`` or
    ``r >= s``. Recommended memory :class:`~grace_legacy.memories.DGCMemory`."""

    def __init__(self, ratio: float | None = None, *, seed: int = 0, sample_ratio: float = 0.01,
                 min_samples: int = 128) -> None:
        super().__init__(ratio)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"DGC: seed must be an int, got {seed!r}")
        for argument, value in (("sample_ratio", sample_ratio), ("min_samples", min_samples)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ArgumentTypeError(f"DGC: {argument} must be a number, got {value!r} of type "
                                        f"{type(value).__name__}")
        if not 0 < sample_ratio <= 1:
            raise ValueError(f"DGC: sample_ratio must be a number in (0, 1], got {sample_ratio!r}")
        if not isinstance(min_samples, numbers.Integral) or min_samples < 1:
            raise ValueError(f"DGC: min_samples must be an integer >= 1, got {min_samples!r}")
        self.seed = seed
        self.sample_ratio = float(sample_ratio)
        self.min_samples = int(min_samples)

    def sample_size(self, numel: int) -> int:
        """How many positions are sampled for a tensor of ``numel`` elements."""
        return max(self.min_samples, math.ceil(self.sample_ratio * numel))

    @staticmethod
    def estimate_order(k: int, samples: int, numel: int) -> int:
        """Which largest sampled magnitude (1-based) estimates the threshold (step 2 above)."""
        return selection.estimate_order(k, samples, numel)

    def sample_indices(self, name: str, step: int, numel: int) -> torch.Tensor | None:
        """The positions (int64) sampled for ``name`` at its ``step``-th compression on this rank;
        ``None`` where ``numel`` is too few to sample."""
        samples = self.sample_size(numel)
        if samples >= numel:
            return None
        generator = self.generator(self.seed, name, step, per_rank=True)
        return torch.randint(0, numel, (samples,), generator=generator)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "DGC")
        self.check_ready()
        step = self.next_step(name)
        flat = tensor.reshape(-1)
        numel = flat.numel()
        k = kept_count(self.ratio, numel)
        sample = self.sample_indices(name, step, numel)
        r = None if sample is None else self.estimate_order(k, sample.numel(), numel)
        if sample is None or r >= sample.numel():
            indices = torch.topk(flat.abs(), k, sorted=False).indices
        else:
            sampled = flat.index_select(0, sample.to(flat.device)).abs()  # flat[sample] is slower on CPU
            estimate = torch.topk(sampled, r, sorted=False).values.min()
            indices = top_k_at_or_above(flat, k, estimate)
        ctx = SparseContext(tensor.shape, numel, tensor.dtype, tensor.device)
        return [flat.index_select(0, indices), indices.to(index_dtype(numel))], ctx

    def recommended_memory(self) -> Memory:
        return DGCMemory()

    def __repr__(self) -> str:
        return (f"DGC(ratio={self.ratio!r}, seed={self.seed}, sample_ratio={self.sample_ratio!r}, "
                f"min_samples={self.min_samples})")
