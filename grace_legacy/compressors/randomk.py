"""Random-k: keep entries chosen at random, the same ones on every rank, so they can be summed."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grace_legacy.compressors.entries import DENSITY, kept_count
from grace_legacy.compressors.sparse import SparseContext, densify
from grace_legacy.core.compressor import Payload, Randomized, Sparsifier, Tunable
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import check_gradient


def uniform_subset(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct integers from ``range(n)`` (int64), every ``k``-subset equally likely: the
    first ``k`` of a permutation for ``k > n / 4``, else the first ``k`` distinct values of a stream
    of uniform draws (the same distribution, in ``O(k log k)``; ``k`` draws hold about ``k^2 / 2n``
    repeats, so a stream of ``k + 2 k^2 / n + 64`` rarely needs topping up)."""
    if 4 * k > n:
        return torch.randperm(n, generator=generator)[:k]
    draws = torch.randint(n, (k + 2 * k * k // n + 64,), generator=generator)
    while True:
        # np.unique's return_index is each distinct value's first position in the stream.
        _, first = np.unique(draws.numpy(), return_index=True)
        if first.size >= k:
            return draws[torch.from_numpy(np.sort(first)[:k])]
        missing = k - first.size
        draws = torch.cat([draws, torch.randint(n, (2 * missing + 64,), generator=generator)])


class RandomK(Randomized, Sparsifier, Tunable):
    """Keeps ``k = max(1, floor(ratio * n))`` entries chosen uniformly at random, unscaled. The
    indices are a function of ``(seed, name, step)``, not of the rank, so every rank picks the same
    ones: only the values travel, summed by an allreduce. Pairs with ``Residual``."""

    parameter = DENSITY
    traits = Traits(additive=True, sends_entries=True)

    def __init__(self, ratio: float | None = None, seed: int = 0) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"RandomK: seed must be an int, got {seed!r}")
        self._set_value(ratio)
        self.seed = seed

    @property
    def ratio(self) -> float | None:
        return self.value

    def indices(self, name: str, step: int, numel: int) -> torch.Tensor:
        """The indices kept for tensor ``name`` at its ``step``-th compression (int64, distinct,
        in no particular order): a uniformly random ``k``-subset of ``range(numel)``."""
        generator = self.generator(self.seed, name, step, per_rank=False)
        return uniform_subset(numel, kept_count(self.ratio, numel), generator)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "RandomK")
        self.check_ready()
        step = self.next_step(name)
        flat = tensor.reshape(-1)
        indices = self.indices(name, step, flat.numel()).to(tensor.device)
        ctx = (indices, SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device))
        return [flat.index_select(0, indices)], ctx  # flat[indices] is slower on CPU

    def decompress(self, payload: Payload, ctx: Any) -> torch.Tensor:
        indices, shape = ctx
        return densify(payload[0], indices, shape)

    def support(self, payload: Payload, ctx: Any) -> torch.Tensor:
        """The flat indices whose values ``payload`` carries (what DGC's factor masking zeroes)."""
        return ctx[0]

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(kept_count(self.ratio, numel), dtype)]

    def __repr__(self) -> str:
        return f"RandomK(ratio={self.ratio!r}, seed={self.seed})"

    def recommended_memory(self):
        return Residual()
