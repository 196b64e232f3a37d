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
from grace_legacy.core.compressor import Payload
from grace_legacy.core.memory import Memory
from grace_legacy.memories.dgc import DGCMemory
from grace_legacy.runtime.validation import ArgumentTypeError, check_gradient


class DGC(TopK):
    """Deep Gradient Compression's sparsifier: the ``k = max(1, floor(ratio * n))`` entries of
    largest magnitude, like :class:`TopK`, found the DGC way (Lin et al. 2018: sample 0.1% to 1%
    of the entries, take the threshold from the sample, then a top-k over the entries above it).

    1. Draw ``s = max(min_samples, ceil(sample_ratio * n))`` positions uniformly, with
       replacement, from :meth:`generator` seeded by ``(seed, rank, name, step)``: private (the
       global RNG is never touched), different on every rank, reproducible.
    2. Of the ``mu = k s / n`` sampled entries expected among the top k, take the sample's
       ``r = ceil(mu + 3 sqrt(mu)) + 1``-th largest magnitude as the threshold: about three
       standard deviations of the sampled count below the k-th largest, so it rarely selects too
       few, while the ``n r / s ~ k + 3 sqrt(k n / s) + n / s`` candidates above it stay a small
       fraction of ``n``.
    3. :func:`~grace_legacy.compressors.kernels.selection.top_k_at_or_above` makes the selection exact
       (one candidate pass, then a top-k among the candidates): the result is the set
       ``torch.topk`` would pick (ties aside), whether the estimate selected too many or too few.

    Small tensors (``s >= n``) and densities for which the sample cannot help (``r >= s``) take a
    plain ``torch.topk``. Non-finite entries are kept first, as :class:`TopK` keeps them (NaN above
    infinity above every finite magnitude).

    Payload as :class:`TopK`: ``[values, int32 indices]``, ``k * (element size + 4)`` bytes (``8k``
    for fp32; int64 indices from 2**31 elements on), the same size on every rank. Any floating
    dtype (fp32, fp16, bf16, fp64). Recommended memory: :class:`~grace_legacy.memories.DGCMemory`
    (momentum correction and factor masking).
    """

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
        """Which largest sampled magnitude (1-based) estimates the threshold (see the class doc)."""
        return selection.estimate_order(k, samples, numel)

    def sample_indices(self, name: str, step: int, numel: int) -> torch.Tensor | None:
        """The positions (int64) sampled for tensor ``name`` at its ``step``-th compression on this
        rank, or ``None`` where no sample is drawn (``numel`` elements are too few to sample)."""
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
