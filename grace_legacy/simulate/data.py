"""Each simulated worker's share of the training set, the micro-batches it draws from it, and which
workers take part in a step: what federated and data-parallel studies vary.

* **IID shards** (:meth:`Shards.iid`): a random permutation of the samples dealt out like cards,
  worker ``w`` taking positions ``w, w + W, w + 2W, ...`` (``DistributedSampler``'s split), so shard
  sizes differ by at most one.
* **Non-IID shards** (:meth:`Shards.dirichlet`, Hsu et al. 2019): for every class ``c`` a draw
  ``q_c ~ Dirichlet(alpha, ..., alpha)`` over the ``W`` workers, and class ``c``'s samples, in a
  random order, split among the workers in the proportions ``q_c``. A small ``alpha`` gives each
  worker few classes; a large one approaches IID. A draw that leaves a worker fewer samples than its
  micro-batch is drawn again (at most :data:`DIRICHLET_TRIES` times; then ``ValueError``).
* **Micro-batches**: each worker goes through its shard in a random order of its own, ``batch_size``
  samples a step, and starts a fresh order when fewer than ``batch_size`` remain.
* **Partial participation** (:func:`participants`): a uniformly random ``round(fraction * W)`` of
  the workers (at least one) each step, as federated averaging samples its clients.

Every draw comes from generators seeded from ``seed`` (and the worker), never the global RNG, so a
run is reproducible and arms run with the same seed see the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from grace_legacy.core.seeds import derived_seed
from grace_legacy.runtime.validation import ArgumentTypeError, check_positive_int, positive_number

#: Draws of a Dirichlet split before giving up on one that leaves every worker a micro-batch.
DIRICHLET_TRIES = 100


def _generator(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*key) % 2**63)


class Shards:
    """``W`` workers' shards of ``(inputs, targets)`` (index tensors, one per worker) and their
    micro-batch draws; build with :meth:`iid` or :meth:`dirichlet`."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, shards: Sequence[torch.Tensor],
                 batch_size: int, seed: int) -> None:
        self.inputs, self.targets = inputs, targets
        self.shards = [s.clone() for s in shards]
        self.batch_size, self.seed = batch_size, seed
        small = [w for w, s in enumerate(self.shards) if len(s) < batch_size]
        if small:
            raise ValueError(f"Shards: workers {small[:8]}{'...' if len(small) > 8 else ''} hold fewer samples than a "
                             f"micro-batch of {batch_size}; use fewer workers or a smaller batch_size")
        self._orders: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64) for _ in self.shards]
        self._passes = [0] * len(self.shards)

    @property
    def workers(self) -> int:
        return len(self.shards)

    @property
    def steps_per_epoch(self) -> int:
        """Steps in which all workers together draw about the whole training set once."""
        return max(1, len(self.targets) // (self.workers * self.batch_size))

    @classmethod
    def iid(cls, inputs: torch.Tensor, targets: torch.Tensor, workers: int, batch_size: int,
            seed: int = 0) -> Shards:
        """IID shards (see the module docstring)."""
        workers, batch_size, count = _checked(inputs, targets, workers, batch_size, "Shards.iid")
        order = torch.randperm(count, generator=_generator("iid", seed))
        return cls(inputs, targets, [order[w::workers] for w in range(workers)], batch_size, seed)

    @classmethod
    def dirichlet(cls, inputs: torch.Tensor, targets: torch.Tensor, workers: int, batch_size: int, alpha: float,
                  seed: int = 0) -> Shards:
        """Non-IID shards by a Dirichlet split of every class with concentration ``alpha`` (see the
        module docstring); ``targets`` are class labels."""
        workers, batch_size, count = _checked(inputs, targets, workers, batch_size, "Shards.dirichlet")
        alpha = positive_number(alpha, "alpha", "Shards.dirichlet")
        if targets.dim() != 1 or targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"Shards.dirichlet: targets must be a 1-D tensor of integer class labels, got "
                             f"{tuple(targets.shape)} {targets.dtype}")
        generator = _generator("dirichlet", seed)
        concentration = torch.full((workers,), alpha, dtype=torch.float64)
        classes = [torch.nonzero(targets == c).reshape(-1) for c in torch.unique(targets).tolist()]
        for _ in range(DIRICHLET_TRIES):
            parts: list[list[torch.Tensor]] = [[] for _ in range(workers)]
            for members in classes:
                members = members[torch.randperm(len(members), generator=generator)]
                shares = _dirichlet(concentration, generator)
                cuts = torch.round(torch.cumsum(shares, 0) * len(members)).to(torch.int64).tolist()
                start = 0
                for w, stop in enumerate(cuts):
                    parts[w].append(members[start:stop])
                    start = stop
            shards = [torch.cat(p) for p in parts]
            if min(len(s) for s in shards) >= batch_size:
                return cls(inputs, targets, shards, batch_size, seed)
        raise ValueError(f"Shards.dirichlet: {DIRICHLET_TRIES} Dirichlet draws with alpha={alpha} all left some of "
                         f"{workers} workers fewer than {batch_size} of the {count} samples; use a larger alpha, "
                         f"fewer workers or a smaller batch_size")

    def sizes(self) -> list[int]:
        return [len(s) for s in self.shards]

    def batches(self, workers: Sequence[int] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The next micro-batch of each of ``workers`` (all when ``None``), by worker."""
        chosen = range(self.workers) if workers is None else workers
        out = {}
        for w in chosen:
            if not 0 <= w < self.workers:
                raise ValueError(f"Shards.batches: worker {w} is not in [0, {self.workers})")
            if len(self._orders[w]) < self.batch_size:
                shard = self.shards[w]
                self._orders[w] = shard[torch.randperm(len(shard), generator=_generator("order", self.seed, w,
                                                                                        self._passes[w]))]
                self._passes[w] += 1
            picked, self._orders[w] = self._orders[w][:self.batch_size], self._orders[w][self.batch_size:]
            out[w] = (self.inputs[picked], self.targets[picked])
        return out


def _checked(inputs: torch.Tensor, targets: torch.Tensor, workers: int, batch_size: int,
             owner: str) -> tuple[int, int, int]:
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ArgumentTypeError(f"{owner}: inputs and targets must be tensors, got {type(inputs).__name__} and "
                                f"{type(targets).__name__}")
    if inputs.dim() == 0 or targets.dim() == 0 or len(inputs) != len(targets):
        raise ValueError(f"{owner}: inputs and targets must hold the same number of samples along dimension 0, got "
                         f"{tuple(inputs.shape)} and {tuple(targets.shape)}")
    workers = check_positive_int(workers, "workers", owner)
    batch_size = check_positive_int(batch_size, "batch_size", owner)
    count = len(targets)
    if workers * batch_size > count:
        raise ValueError(f"{owner}: {workers} workers with micro-batches of {batch_size} need at least "
                         f"{workers * batch_size} samples, got {count}")
    return workers, batch_size, count


def _dirichlet(concentration: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw of a Dirichlet distribution from ``generator``: normalized Gamma(alpha, 1) draws,
    each by Marsaglia and Tsang's method (``torch.distributions`` draws from the global RNG)."""
    gammas = torch.tensor([_gamma(float(a), generator) for a in concentration], dtype=torch.float64)
    total = gammas.sum()
    if not total > 0:  # every draw underflowed (a tiny alpha): all to one worker, chosen at random
        gammas = torch.zeros_like(gammas)
        gammas[int(torch.randint(len(gammas), (1,), generator=generator))] = 1.0
        total = gammas.sum()
    return gammas / total


def _gamma(alpha: float, generator: torch.Generator) -> float:
    """A Gamma(alpha, 1) draw (Marsaglia and Tsang 2000; for alpha < 1, boosted by U^(1/alpha))."""
    boost = 1.0
    if alpha < 1.0:
        boost = float(torch.rand((), generator=generator, dtype=torch.float64)) ** (1.0 / alpha)
        alpha += 1.0
    d = alpha - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        x = float(torch.randn((), generator=generator, dtype=torch.float64))
        v = (1.0 + c * x) ** 3
        if v <= 0:
            continue
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if math.log(u) < 0.5 * x * x + d - d * v + d * math.log(v):
            return d * v * boost


def participants(workers: int, fraction: float, generator: torch.Generator) -> list[int]:
    """A uniformly random ``max(1, round(fraction * workers))`` of ``workers`` workers, sorted
    (``fraction`` in (0, 1]); all of them when ``fraction`` is 1."""
    workers = check_positive_int(workers, "workers", "participants")
    fraction = positive_number(fraction, "fraction", "participants")
    if fraction > 1:
        raise ValueError(f"participants: fraction must be in (0, 1], got {fraction!r}")
    count = max(1, round(fraction * workers))
    if count == workers:
        return list(range(workers))
    return sorted(torch.randperm(workers, generator=generator)[:count].tolist())
