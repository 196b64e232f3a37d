"""Collectives through Horovod (MPI, Gloo or NCCL underneath, whichever horovodrun chose)."""

from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import torch

#: The first and the longest sleep between two polls of an unfinished collective. The sleeps
#: double from the first to the longest, so a wait notices its result at most about as late as
#: it has already waited, and never more than the longest sleep late.
FIRST_POLL_SLEEP_S = 1e-5
LONGEST_POLL_SLEEP_S = 1e-3


def synchronize(handle: Any) -> torch.Tensor:
    """``hvd.synchronize(handle)``, waiting asleep instead of busy.

    Horovod's own wait calls ``sched_yield`` in a loop, so a waiting rank keeps a core busy for
    as long as it waits. Where ranks share cores (several CPU workers on one host, or a busy
    host), the ranks that finish their backward pass first then take CPU time from the ranks
    they are waiting for. Sleeping costs at most ``LONGEST_POLL_SLEEP_S`` of latency per wait,
    which costs nothing measurable when every rank has a core of its own; the waiting benchmark
    (``benchmarks/performance/waiting.py``, results in ``benchmarks/results/performance.md``)
    measures both cases.
    """
    sleep = FIRST_POLL_SLEEP_S
    while not hvd.poll(handle):
        time.sleep(sleep)
        sleep = min(2 * sleep, LONGEST_POLL_SLEEP_S)
    return hvd.synchronize(handle)


class HorovodBackend:
    """Asynchronous Horovod collectives restricted to one process set.

    Names are prefixed so they never collide with the user's own Horovod ops; Horovod matches
    collectives across ranks by name, so every rank must pass the same names in any order. The
    prefix does not depend on the kind of collective: ranks that disagree on how to send a tensor
    then meet under one name, and Horovod reports the mismatched operation instead of waiting
    for a name nobody else sends.
    """

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = hvd.global_process_set if process_set is None else process_set

    def rank(self) -> int:
        return self.process_set.rank()

    def size(self) -> int:
        return self.process_set.size()

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> Any:
        return hvd.allreduce_async(tensor, name=f"grace.{name}", op=hvd.Average if average else hvd.Sum,
                                   process_set=self.process_set)

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        return hvd.allgather_async(tensor, name=f"grace.{name}", process_set=self.process_set)

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> Any:
        """``root_rank`` is a rank *within the process set*; Horovod wants the global rank."""
        members = self.process_set.ranks
        root = members[root_rank] if members else root_rank
        return hvd.broadcast_async(tensor, root, name=f"grace.bc{root_rank}.{name}", process_set=self.process_set)

    def wait(self, handle: Any) -> torch.Tensor:
        return synchronize(handle)
