"""``P`` ranks' collectives in one process: a :class:`SimulatedWorld` and each rank's
:class:`SimulatedBackend`, the ``Backend`` the library's communicators already talk to, so every
route (allreduce, allgather, broadcast, the scatter-gather's all-to-all, fused buckets) runs its own
code unchanged.

A collective is matched across ranks as Horovod matches it: by name, the ``n``-th use of a name on
one rank meeting the ``n``-th on the others, and it must be of one kind and shape everywhere (else
every rank's wait raises, as Horovod's does). It completes when the last rank launches it; its
result is computed once. The ranks run in lock-step (:mod:`~grace_legacy.simulate.lockstep`): a
rank that waits for a collective not every rank has launched lets the others run.

What the ranks receive: an allgather's rows in rank order (one tensor shared by every rank, read
only: the communicators read it, never write it, which ``share=False`` lets a test confirm); an
allreduce's reduction (:mod:`~grace_legacy.simulate.sums`: the summation order and the average of
the backend simulated), a broadcast's root tensor and an all-to-all's blocks, each rank its own copy.
:meth:`SimulatedBackend.computed_once` lets a communicator compute what every rank would compute
alike from a gathered buffer (a gathered payload's aggregate, the owners' decoded payloads) once
for all ranks, each rank receiving its own copy: the same bits, ``P`` times less work (the
library's guarantee that every rank ends with the same bits is what makes this exact).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from grace_legacy.runtime.validation import check_flag, check_positive_int
from grace_legacy.simulate.lockstep import LockStep
from grace_legacy.simulate.sums import Reduction, resolve_reduction


class _Collective:
    """One collective: what each rank launched, and the result once the last rank did."""

    __slots__ = ("kind", "name", "use", "size", "inputs", "extras", "joined", "fetched", "result", "error",
                 "shared")

    def __init__(self, kind: str, name: str, use: int, size: int) -> None:
        self.kind, self.name, self.use, self.size = kind, name, use, size
        self.inputs: list[torch.Tensor | None] = [None] * size
        self.extras: list[Any] = [None] * size
        self.joined = 0
        self.fetched = 0
        self.result: Any = None
        self.error: str | None = None
        #: results computed once for every rank (SimulatedBackend.computed_once)
        self.shared: dict[Hashable, Any] = {}

    @property
    def complete(self) -> bool:
        return self.joined == self.size

    def describe(self) -> str:
        ranks = [r for r, t in enumerate(self.inputs) if t is not None]
        return (f"{self.kind} {self.name!r} (use {self.use}), launched by {len(ranks)} of {self.size} ranks: "
                f"{_ranges(ranks)}")


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "none"


def _copied(value: Any) -> Any:
    """``value`` with every tensor in it cloned (lists, tuples and dicts walked)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


class SimulatedWorld:
    """The collectives of ``size`` ranks run in lock-step by ``lockstep`` (see the module docstring).
    ``reduction``: how an allreduce sums and averages (a name of
    :data:`~grace_legacy.simulate.sums.REDUCTIONS` or a :class:`~grace_legacy.simulate.sums.Reduction`);
    ``share``: hand every rank the one gathered tensor and let communicators compute results
    every rank shares once (``False``: every rank its own copy and its own computation, for tests)."""

    def __init__(self, size: int, lockstep: LockStep, *, reduction: str | Reduction = "rank-order",
                 share: bool = True) -> None:
        self.size = check_positive_int(size, "size", "SimulatedWorld")
        if not isinstance(lockstep, LockStep):
            raise TypeError(f"SimulatedWorld: lockstep must be a LockStep, got {type(lockstep).__name__}")
        if lockstep.size < self.size:
            raise ValueError(f"SimulatedWorld: a LockStep of {lockstep.size} workers cannot run {self.size} ranks")
        self.lockstep = lockstep
        self.reduction = resolve_reduction(reduction)
        self.share = check_flag(share, "share", "SimulatedWorld")
        self._open: dict[tuple[str, int], _Collective] = {}
        self._uses: list[dict[str, int]] = [{} for _ in range(self.size)]
        self.backends = [SimulatedBackend(self, rank) for rank in range(self.size)]

    def backend(self, rank: int) -> SimulatedBackend:
        return self.backends[rank]

    def pending(self) -> list[str]:
        """The collectives some rank launched that have not been fetched by every rank."""
        return [c.describe() for c in self._open.values()]

    def abandon(self) -> None:
        """Forget every collective in flight and every count of names (after a failed step)."""
        self._open.clear()
        self._uses = [{} for _ in range(self.size)]

    # -- launching and completing -------------------------------------------------------------
    def launch(self, kind: str, rank: int, name: str, tensor: torch.Tensor, extra: Any = None) -> _Collective:
        use = self._uses[rank].get(name, 0)
        self._uses[rank][name] = use + 1
        key = (name, use)
        collective = self._open.get(key)
        if collective is None:
            collective = self._open[key] = _Collective(kind, name, use, self.size)
        if collective.kind != kind:
            collective.error = (f"{name!r} (use {use}) was launched as {collective.kind} by some ranks and as "
                                f"{kind} by rank {rank}")
        collective.inputs[rank] = tensor.detach().clone()
        collective.extras[rank] = extra
        collective.joined += 1
        if collective.complete and collective.error is None:
            try:
                collective.result = self._complete(collective)
            except (ValueError, TypeError, RuntimeError) as error:
                collective.error = f"{kind} {name!r}: {error}"
        return collective

    def _complete(self, c: _Collective) -> Any:
        tensors: list[torch.Tensor] = c.inputs  # type: ignore[assignment]  (every rank joined)
        if c.kind == "allreduce":
            _same(tensors, lambda t: (tuple(t.shape), t.dtype), "shapes and dtypes")
            average = c.extras[0]
            if average and not tensors[0].is_floating_point():
                raise TypeError(f"an average needs a floating-point tensor, got {tensors[0].dtype}")
            return self.reduction(tensors, average)
        if c.kind == "allgather":
            _same(tensors, lambda t: (tuple(t.shape[1:]), t.dtype), "trailing shapes and dtypes")
            return torch.cat(tensors)
        if c.kind == "broadcast":
            _same(tensors, lambda t: (tuple(t.shape), t.dtype), "shapes and dtypes")
            return tensors[c.extras[0]]
        if c.kind == "alltoall":
            _same(tensors, lambda t: (tuple(t.shape[1:]), t.dtype), "trailing shapes and dtypes")
            blocks = [torch.split(t, splits) for t, splits in zip(tensors, c.extras, strict=True)]
            return [torch.cat([blocks[sender][receiver] for sender in range(self.size)])
                    for receiver in range(self.size)]
        raise AssertionError(c.kind)

    def wait(self, collective: _Collective, rank: int) -> torch.Tensor:
        self.lockstep.wait_until(lambda: collective.complete, collective.describe)
        collective.fetched += 1
        if collective.fetched == self.size:
            self._open.pop((collective.name, collective.use), None)
        if collective.error is not None:
            raise RuntimeError(f"simulated {collective.error}")
        result = collective.result
        if collective.kind == "alltoall":
            return result[rank]
        if collective.kind == "allgather" and self.share:
            return result
        return result.clone()


def _same(tensors: Sequence[torch.Tensor], key: Callable[[torch.Tensor], Any], what: str) -> None:
    keys = [key(t) for t in tensors]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"the ranks' {what} differ: {keys}")


class SimulatedBackend:
    """One simulated rank's ``Backend`` (``grace_legacy.core.backend``) in a :class:`SimulatedWorld`."""

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self.world, self._rank = world, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> _Collective:
        return self.world.launch("allreduce", self._rank, name, tensor, bool(average))

    def allgather_async(self, tensor: torch.Tensor, name: str) -> _Collective:
        if tensor.dim() == 0:
            raise ValueError(f"allgather {name!r}: a 0-dim tensor has no rows to gather; reshape it to (1,)")
        return self.world.launch("allgather", self._rank, name, tensor)

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> _Collective:
        if not 0 <= root_rank < self.world.size:
            raise ValueError(f"broadcast {name!r}: root_rank must be in [0, {self.world.size}), got {root_rank}")
        return self.world.launch("broadcast", self._rank, f"bc{root_rank}.{name}", tensor, root_rank)

    def alltoall_async(self, tensor: torch.Tensor, splits: list[int], name: str) -> _Collective:
        if len(splits) != self.world.size or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {splits} must give each of {self.world.size} ranks its "
                             f"rows of the {tensor.shape[0]}")
        return self.world.launch("alltoall", self._rank, name, tensor, list(splits))

    def wait(self, handle: _Collective) -> torch.Tensor:
        return self.world.wait(handle, self._rank)

    def computed_once(self, handle: _Collective, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()``, a result every rank computes alike from what ``handle`` delivered: the
        first rank to ask computes it, every rank receives a copy of its own (``share=False``: each
        computes it)."""
        if not self.world.share:
            return compute()
        if key not in handle.shared:
            handle.shared[key] = compute()
        return _copied(handle.shared[key])
