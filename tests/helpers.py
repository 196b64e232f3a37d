"""What many tests share: an in-process stand-in for Horovod, and bit-for-bit float comparison.

``World``/``ThreadBackend``/``run_ranks``: ``P`` threads, one per rank, and collectives between
them. They implement the ``Backend`` protocol with the semantics the communicators rely on and
the checks Horovod makes: a collective completes once every rank has submitted it under the same
name; an allgather concatenates along dim 0 in rank order; a broadcast returns the root's tensor
and fails, as Horovod does, when the ranks' tensors differ in shape or dtype. Their memory stays
flat over any number of steps: a collective is forgotten once every rank has fetched its result,
and each rank keeps only its last ``CALLS_KEPT`` calls. ``ThreadBackend(World(1), 0)`` is a
one-rank backend.

``bits``: floats compared bit for bit, where -0.0 differs from 0.0 and each NaN keeps its sign
and payload.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

#: A collective a rank waits on longer than this is reported as never completed. Only a hang
#: detector: generous, because the first call compiles numba kernels and the machine may be loaded.
TIMEOUT_S = 120.0
#: How many of its most recent collectives each rank's ``calls`` remembers.
CALLS_KEPT = 100_000


class World:
    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._submitted: dict[tuple, dict[int, tuple]] = {}
        self._results: dict[tuple, Any] = {}
        self._fetched: dict[tuple, int] = {}

    def submit(self, key: tuple, rank: int, tensor: torch.Tensor, extra: Any) -> tuple:
        with self._cond:
            entries = self._submitted.setdefault(key, {})
            if rank in entries:
                raise RuntimeError(f"rank {rank} submitted {key} twice")
            entries[rank] = (tensor.detach().clone(), extra)
            if len(entries) == self.size:
                self._results[key] = self._complete(key, entries)
                self._cond.notify_all()
        return key

    def _complete(self, key: tuple, entries: dict[int, tuple]) -> Any:
        kind = key[0]
        tensors = [entries[r][0] for r in range(self.size)]
        if kind == "allgather":
            if len({t.shape[1:] for t in tensors}) != 1 or len({t.dtype for t in tensors}) != 1:
                return RuntimeError(f"allgather {key}: mismatched trailing shapes or dtypes")
            return torch.cat(tensors)
        if kind == "broadcast":
            root = key[1]
            if len({(tuple(t.shape), t.dtype) for t in tensors}) != 1:
                return RuntimeError(f"broadcast {key}: mismatched shapes {[tuple(t.shape) for t in tensors]}")
            return tensors[root]
        if kind == "alltoall":
            blocks = [torch.split(tensors[r], entries[r][1]) for r in range(self.size)]
            return [torch.cat([blocks[r][j] for r in range(self.size)]) for j in range(self.size)]
        if kind == "allreduce":
            total = tensors[0].clone()
            for t in tensors[1:]:
                total += t
            if entries[0][1]:
                total /= self.size
            return total
        raise AssertionError(kind)

    def wait(self, key: tuple, rank: int = 0) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._results, timeout=TIMEOUT_S):
                raise TimeoutError(f"collective {key} never completed: only ranks "
                                   f"{sorted(self._submitted.get(key, {}))} joined it")
            result = self._results[key]
            fetched = self._fetched.get(key, 0) + 1
            if fetched == self.size:  # every rank has its result: forget the collective
                del self._results[key], self._submitted[key]
                self._fetched.pop(key, None)
            else:
                self._fetched[key] = fetched
        if isinstance(result, Exception):
            raise result
        if isinstance(result, list):  # an all-to-all: each rank receives its own
            result = result[rank]
        return result.clone()


class ThreadBackend:
    """One rank's view of a :class:`World`; counts what it hands over, like ``bytes_sent``."""

    def __init__(self, world: World, rank: int) -> None:
        self.world = world
        self._rank = rank
        self.calls: deque[tuple[str, int]] = deque(maxlen=CALLS_KEPT)
        # Horovod lets a name be reused once its collective is done; the n-th use of a name on
        # one rank meets the n-th use on the others.
        self._uses: dict[tuple, int] = {}

    def _key(self, *key: Any) -> tuple:
        use = self._uses.get(key, 0)
        self._uses[key] = use + 1
        return (*key, use)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.world.size

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> Any:
        self.calls.append(("allreduce", tensor.numel() * tensor.element_size()))
        return self.world.submit(self._key("allreduce", name), self._rank, tensor, average)

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        self.calls.append(("allgather", tensor.numel() * tensor.element_size()))
        return self.world.submit(self._key("allgather", name), self._rank, tensor, None)

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> Any:
        sent = tensor.numel() * tensor.element_size() if root_rank == self._rank else 0
        self.calls.append(("broadcast", sent))
        return self.world.submit(self._key("broadcast", root_rank, name), self._rank, tensor, None)

    def alltoall_async(self, tensor: torch.Tensor, splits: list[int], name: str) -> Any:
        self.calls.append(("alltoall", tensor.numel() * tensor.element_size()))
        return self.world.submit(self._key("alltoall", name), self._rank, tensor, list(splits))

    def wait(self, handle: Any) -> torch.Tensor:
        return self.world.wait(handle, self._rank)


def bucket_of(grads):
    """The gradients back to back in one flat, and views of them in it (as DDP's bucket holds them)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    views, offset = [], 0
    for g in grads:
        views.append(flat[offset:offset + g.numel()].view(g.shape))
        offset += g.numel()
    return flat, views


def run_ranks(size: int, body: Callable[[ThreadBackend], Any]) -> list[Any]:
    """Run ``body(backend)`` on ``size`` threads, one per rank; return each rank's result."""
    world = World(size)
    backends = [ThreadBackend(world, r) for r in range(size)]
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(backends[rank])
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a rank never finished")
    return results


def synchronize(bundles: list[Any], gradients_per_step: list[list[torch.Tensor]], average: bool = True,
                name: str = "w", overwrite: bool = False) -> list[list[torch.Tensor]]:
    """One ``Grace`` bundle per rank, each handed its rank's gradient of ``name`` step after step;
    every step's synchronized gradient per rank (``result[step][rank]``). ``overwrite`` as in
    ``Grace.start``: the gradients are then used up."""
    def body(backend: ThreadBackend) -> list[torch.Tensor]:
        bundle = bundles[backend.rank()]
        return [bundle.start(gradients[backend.rank()], name, backend, average, overwrite=overwrite)()
                for gradients in gradients_per_step]

    per_rank = run_ranks(len(bundles), body)
    return [[per_rank[rank][step] for rank in range(len(bundles))] for step in range(len(gradients_per_step))]


# -- bit for bit --------------------------------------------------------------------------------

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s entries, flattened, as same-width integers."""
    return t.reshape(-1).view(_SAME_WIDTH_INT[t.element_size()])


def free_port() -> int:
    """A TCP port on loopback that was free when asked: nothing listens there until a test (or the
    launcher it starts) binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_both_cpu_paths(threads: int, run: Callable[[], Any]) -> tuple[Any, Any]:
    """``run()`` with the compiled CPU passes, then with the tensor formulas, on ``threads`` torch
    threads (the compiled passes' thread count follows it)."""
    from grace_legacy.compressors.kernels import compiled

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for enabled in (True, False):
            compiled.ENABLED = enabled
            results.append(run())
    finally:
        compiled.ENABLED = True
        torch.set_num_threads(before)
    return results[0], results[1]


def fault_seed() -> int:
    """The seed of a run's random faults: ``GRACE_FAULT_SEED`` when set (a replay), else drawn at random."""
    if "GRACE_FAULT_SEED" in os.environ:
        return int(os.environ["GRACE_FAULT_SEED"])
    return random.SystemRandom().randrange(2**31)
