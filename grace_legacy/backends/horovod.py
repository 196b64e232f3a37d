"""Collectives through Horovod (MPI, Gloo or NCCL underneath, whichever horovodrun chose)."""

from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import horovod.torch.mpi_ops as _hvd_mpi_ops
import torch

from grace_legacy.backends.board import BoardAddress, ProgressBoard, host_address
from grace_legacy.runtime.lending import Lender
from grace_legacy.runtime.stall import RanksStalled, resolve_stall_timeout

#: The first and the longest sleep between two polls of an unfinished collective; the sleeps double
#: (docs/DESIGN.md#waiting-asleep).
FIRST_POLL_SLEEP_S = 1e-5
LONGEST_POLL_SLEEP_S = 1e-3


def synchronize(handle: Any) -> torch.Tensor:
    """``hvd.synchronize(handle)``, waiting asleep instead of busy: the result is noticed at most about
    as late as the wait has lasted, and never more than ``LONGEST_POLL_SLEEP_S`` late."""
    sleep = FIRST_POLL_SLEEP_S
    while not hvd.poll(handle):
        time.sleep(sleep)
        sleep = min(2 * sleep, LONGEST_POLL_SLEEP_S)
    return hvd.synchronize(handle)


class Launched:
    """A collective in flight: Horovod's handle, the collective's name (for errors) and whether it is
    an all-to-all (whose result is the first of Horovod's two). Kept with the handle, never in a
    table by handle number: Horovod numbers handles afresh after an elastic reset, so a number the
    previous world left unwaited (a step cut by a fault) names another collective of the next."""

    __slots__ = ("handle", "name", "alltoall", "summed")

    def __init__(self, handle: Any, name: str, alltoall: bool = False) -> None:
        self.handle, self.name, self.alltoall = handle, name, alltoall
        self.summed: _GatheredSum | None = None  # a bfloat16 allreduce carried by a gather

    def finish(self, synchronize: Any = hvd.synchronize) -> torch.Tensor:
        """The result, through ``synchronize`` (Horovod's by default) of the handle."""
        result = synchronize(self.handle)
        if self.summed is not None:
            return self.summed.finish(result)
        return result[0] if self.alltoall else result


class HorovodBackend:
    """Asynchronous Horovod collectives on one process set. Horovod matches collectives by name, so
    every rank passes the same names, in any order; a prefix keeps them apart from the user's own
    (docs/DESIGN.md#collective-names). :meth:`wait` raises
    :class:`~grace_legacy.runtime.stall.RanksStalled` after the stall timeout, naming the ranks it
    waits for once :meth:`open_board` has opened a progress board."""

    def __init__(self, process_set: Any = None, stall_timeout_s: float | None = None) -> None:
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.stall_timeout_s = resolve_stall_timeout(stall_timeout_s)
        self.board: ProgressBoard | None = None
        self._lender = Lender()

    def labels(self) -> list[int]:
        """Each member's global rank, by its rank in the process set."""
        return list(self.process_set.ranks) if self.process_set.ranks else list(range(self.size()))

    def open_board(self) -> None:
        """Open the process set's progress board, hosted by its first member: a collective (every
        member calls it, once the set is in use). A set of one rank opens none."""
        if self.size() == 1:
            return
        board = f"set{self.process_set.process_set_id}"
        mine = host_address(board, self.size()).to_text().encode() if self.rank() == 0 else b""
        length = int(self.wait(self.broadcast_async(torch.tensor([len(mine)]), 0, "board.length")).item())
        text = torch.tensor(list(mine), dtype=torch.uint8) if mine else torch.zeros(length, dtype=torch.uint8)
        address = bytes(self.wait(self.broadcast_async(text, 0, "board.address")).tolist()).decode()
        self.board = ProgressBoard(board, self.rank(), self.labels(), BoardAddress.from_text(address))

    def rank(self) -> int:
        return self.process_set.rank()

    def size(self) -> int:
        return self.process_set.size()

    def _launch(self, start: Any, inputs: tuple[torch.Tensor, ...], name: str, alltoall: bool = False) -> Launched:
        """``start(*inputs)``, every tensor Horovod is handed held from C++ until Horovod lets go of
        it (:mod:`grace_legacy.runtime.lending`): Horovod's background thread lets go of a failed
        collective's tensors while it holds the process-set lock that the next launch waits for with
        the GIL, a deadlock if that release needed the GIL (docs/DESIGN.md#clean-exit). The outputs
        are the ones Horovod's wrapper made, from its table of handles (Horovod 0.28.1)."""
        self._lender.lend(inputs)
        handle = start(*inputs)
        # Horovod's table of handles (rebound at each init) holds the input and the outputs.
        entry = getattr(_hvd_mpi_ops, "_handle_map", {}).get(handle)
        if entry is not None:
            outputs = entry[-1] if isinstance(entry[-1], tuple) else (entry[-1],)
            self._lender.lend([t for t in outputs if isinstance(t, torch.Tensor)], taken=True)
        return Launched(handle, name, alltoall)

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool) -> Launched:
        """The sum (or mean) of every member's ``tensor``. Horovod cannot reduce bfloat16 tensors (it
        refuses their type), so a bfloat16 one is gathered instead and summed on arrival
        (:class:`_GatheredSum`): the same bytes handed over, the same result on every rank."""
        if tensor.dtype == torch.bfloat16:
            rows = tensor.detach().reshape(1, -1).view(torch.int16)  # bits only: Horovod moves int16
            launched = self._launch(lambda t: hvd.allgather_async(t, name=f"grace.{name}",
                                                                  process_set=self.process_set), (rows,), name)
            launched.summed = _GatheredSum(tensor.shape, average)
            return launched
        op = hvd.Average if average else hvd.Sum
        return self._launch(lambda t: hvd.allreduce_async(t, name=f"grace.{name}", op=op, process_set=self.process_set),
                            (tensor,), name)

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Launched:
        return self._launch(lambda t: hvd.allgather_async(t, name=f"grace.{name}", process_set=self.process_set),
                            (tensor,), name)

    def alltoall_async(self, tensor: torch.Tensor, splits: list[int], name: str) -> Launched:
        # Horovod's alltoall returns (received, received splits): the rows are the result.
        return self._launch(lambda t, s: hvd.alltoall_async(t, splits=s, name=f"grace.{name}",
                                                            process_set=self.process_set),
                            (tensor, torch.tensor(splits, dtype=torch.int32)), name, alltoall=True)

    def broadcast_async(self, tensor: torch.Tensor, root_rank: int, name: str) -> Launched:
        """``root_rank`` is a rank *within the process set*; Horovod wants the global rank."""
        members = self.process_set.ranks
        root = members[root_rank] if members else root_rank
        return self._launch(lambda t: hvd.broadcast_async(t, root, name=f"grace.bc{root_rank}.{name}",
                                                          process_set=self.process_set),
                            (tensor,), f"bc{root_rank}.{name}")

    def wait(self, launched: Launched) -> torch.Tensor:
        """:func:`synchronize`, raising :class:`~grace_legacy.runtime.stall.RanksStalled` after
        ``stall_timeout_s`` plus the board's listening time (the result may still arrive then);
        posts a beat each ``beat_s`` once it has waited that long."""
        handle, name = launched.handle, launched.name
        start = time.monotonic()
        deadline = start + self.stall_timeout_s
        board = self.board
        next_beat = start + board.beat_s if board is not None else float("inf")
        sleep = FIRST_POLL_SLEEP_S
        while not hvd.poll(handle):
            now = time.monotonic()
            if now >= next_beat:
                board.beat(name)
                next_beat = now + board.beat_s
            if now >= deadline:
                self._raise_unless_it_arrives(handle, name, start)
                break
            time.sleep(sleep)
            sleep = min(2 * sleep, LONGEST_POLL_SLEEP_S)
        return launched.finish()

    def _raise_unless_it_arrives(self, handle: Any, name: str, start: float) -> None:
        """Read the board, keep waiting (and beating) for its listening time, read it again, and
        raise :class:`RanksStalled` naming the ranks whose beat did not move, unless the result arrives."""
        board, rank = self.board, self.labels()[self.rank()]
        if board is None:
            if not hvd.poll(handle):
                raise RanksStalled(rank, f"grace.{name}", time.monotonic() - start, None,
                                   "No progress board was opened to find out.")
            return
        before = board.read()
        # Without a first read (the host is silent) there is nothing to compare a second one with.
        until = time.monotonic() + (board.listen_s if before is not None else 0.0)
        next_beat = 0.0
        while time.monotonic() < until:
            if hvd.poll(handle):
                return
            if time.monotonic() >= next_beat:
                board.beat(name)
                next_beat = time.monotonic() + board.beat_s / 2
            time.sleep(LONGEST_POLL_SLEEP_S)
        stalled, detail = board.stalled(before, board.read(), name)
        if not hvd.poll(handle):
            raise RanksStalled(rank, f"grace.{name}", time.monotonic() - start, stalled, detail)


class _GatheredSum:
    """A bfloat16 allreduce carried by an allgather of its bits (Horovod 0.28 has no bfloat16 type).

    Every rank receives every member's row and adds them in member order in float32, exact for
    each bfloat16 value, then divides by the number of members for a mean, and rounds once to
    bfloat16: ``bf16(sum_r x_r)`` or ``bf16(sum_r x_r / P)``, bit for bit the same on every rank.
    Each rank hands Horovod the tensor's own 2 bytes per element, as an allreduce would; a gather
    moves ``(P - 1)`` times that over each rank's link where a ring allreduce moves ``2 (P - 1) / P``
    times, so beyond 4 ranks it costs more link time than even a float32 allreduce of the tensor.
    """

    __slots__ = ("shape", "average")

    def __init__(self, shape: torch.Size, average: bool) -> None:
        self.shape, self.average = shape, average

    def finish(self, gathered: torch.Tensor) -> torch.Tensor:
        rows = gathered.view(torch.bfloat16)
        total = rows[0].float()
        for row in rows[1:]:
            total += row
        if self.average:
            total /= rows.shape[0]
        return total.bfloat16().view(self.shape)
