"""A progress board: which ranks are alive and waiting in a collective, so that a rank whose
collective stalls can name the ranks it waits for (docs/DESIGN.md#stall-detection).

A ``torch.distributed.TCPStore`` on the process set's first rank. A rank waiting longer than
:data:`BEAT_AFTER_S` posts a *beat* (a counter and the collective's name) every :data:`BEAT_AFTER_S`;
the rank that times out reads the beats twice, :attr:`ProgressBoard.listen_s` apart, and names the
ranks whose counter did not move, or the host if it does not answer within :data:`ANSWER_S`.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import psutil
from torch.distributed import TCPStore

#: A wait longer than this posts beats, one every this many seconds.
BEAT_AFTER_S = 1.0

#: How long a read of the board, or a member's first connection, may take before the host counts
#: as not answering: ample, so that a merely slow host is not named as stopped.
ANSWER_S = 10.0


class BoardAddress(NamedTuple):
    """Where a board's host listens: its host name, its store's port, and the addresses of its
    network interfaces (neither loopback nor link-local), the places a member may reach it."""

    host: str
    port: int
    addresses: tuple[str, ...] = ()

    def to_text(self) -> str:
        return " ".join([self.host, str(self.port), *self.addresses])

    @classmethod
    def from_text(cls, text: str) -> BoardAddress:
        host, port, *addresses = text.split(" ")
        return cls(host, int(port), tuple(addresses))

    def candidates(self) -> list[str]:
        """Where a member on this machine tries to reach the host, in order."""
        first = "127.0.0.1" if self.host == socket.gethostname() else self.host
        return [first, *(a for a in self.addresses if a != first)]


def interface_addresses() -> tuple[str, ...]:
    """The IP addresses of this machine's (or network namespace's) interfaces that another machine
    or namespace could reach: not loopback, not link-local."""
    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            address = ipaddress.ip_address(entry.address.partition("%")[0])
            if not (address.is_loopback or address.is_link_local) and str(address) not in found:
                found.append(str(address))
    return tuple(found)


def host_address(board: str, members: int) -> BoardAddress:
    """Host the board named ``board`` for ``members`` members on this rank, every member's beat
    posted as none; return where it listens. One store (any free port, every interface) serves
    every board this process hosts, for as long as the process runs."""
    if not _hosted:
        _hosted.append(TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=ANSWER_S),
                                wait_for_workers=False))
    for rank in range(members):
        _hosted[0].set(ProgressBoard.key(board, rank), "0|")
    return BoardAddress(socket.gethostname(), _hosted[0].port, interface_addresses())


def first_answering(places: Sequence[str], port: int, seconds: float) -> str | None:
    """The first of ``places`` (in their order) that accepts a TCP connection on ``port`` within
    ``seconds``, trying them all at once; ``None`` if none does."""

    def answers(place: str) -> bool:
        try:
            socket.create_connection((place, port), timeout=seconds).close()
            return True
        except OSError:
            return False

    with ThreadPoolExecutor(max_workers=len(places), thread_name_prefix="grace_legacy board probe") as pool:
        for place, answered in zip(places, pool.map(answers, places), strict=True):
            if answered:
                return place
    return None


# The store this process hosts: it must keep answering after the boards that opened it are gone,
# for as long as other members may read it.
_hosted: list[TCPStore] = []

# Connections to other processes' stores, by address, shared by every board on that store.
_clients: dict[tuple[str, int], TCPStore] = {}


def _within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the error it raised, or a ``TimeoutError`` after ``seconds``: the call runs
    on a daemon thread, left behind if it never returns (a client of a stopped host waits forever)."""
    outcome: list[Any] = [TimeoutError(f"no answer within {seconds:g} s")]

    def call() -> None:
        try:
            outcome[0] = fn(*args)
        except (RuntimeError, OSError) as err:
            outcome[0] = err

    thread = threading.Thread(target=call, name="grace_legacy progress board", daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome[0]


class ProgressBoard:
    """One member's view of the board: ``board``, its name (one per process set); ``rank``, this
    member's index in the set; ``labels``, how errors name each member (its global rank);
    ``address``, from :func:`host_address` on the set's first member."""

    def __init__(self, board: str, rank: int, labels: Sequence[int], address: BoardAddress,
                 beat_s: float = BEAT_AFTER_S):
        self.board, self.rank, self.labels, self.beat_s = board, rank, list(labels), beat_s
        self.listen_s = 2 * beat_s + 0.5
        self.unreachable: str | None = None
        #: whether the host stopped answering after this member had reached it
        self.host_silent = False
        self._beats = 0
        self._address = (address.host, address.port)
        self._store: TCPStore | None = _clients.get(self._address)
        if self._store is None:
            self._store = self._connect(address)
            if self._store is not None:
                _clients[self._address] = self._store

    def _connect(self, address: BoardAddress) -> TCPStore | None:
        where = f"{address.host}:{address.port}"
        places = address.candidates()
        place = first_answering(places, address.port, ANSWER_S)
        if place is None:
            self.unreachable = (f"The progress board on rank {self.labels[0]} ({where}) could not be reached "
                                f"when it opened: nothing answered at {', '.join(places)} within {ANSWER_S:g} s.")
            return None
        # Something listens there, so the store connects at once; the thread only guards against
        # the host stopping in between (a client waiting on a stopped host waits forever).
        store = _within(ANSWER_S, TCPStore, place, address.port, None, False, datetime.timedelta(seconds=ANSWER_S))
        if not isinstance(store, TCPStore):
            why = store
        else:
            ours = _within(ANSWER_S, store.check, [ProgressBoard.key(self.board, 0)])
            if ours is True:
                return store
            why = ours if ours is not False else "a store without this board answered"
        self.unreachable = (f"The progress board on rank {self.labels[0]} ({where}) could not be opened at "
                            f"{place}:{address.port} ({why}).")
        return None

    @staticmethod
    def key(board: str, rank: int) -> str:
        """Where member ``rank`` of board ``board`` posts its beat."""
        return f"grace_legacy.{board}.beat.{rank}"

    def beat(self, collective: str) -> None:
        """Post that this member is alive and waiting for ``collective``."""
        if self._store is None:
            return
        self._beats += 1
        try:
            self._store.set(ProgressBoard.key(self.board, self.rank), f"{self._beats}|{collective}")
        except (RuntimeError, OSError) as err:
            self._lost(err)

    def read(self) -> dict[int, tuple[int, str]] | None:
        """Every member's (beat counter, collective); ``None`` if the board does not answer."""
        store = self._store
        if store is None:
            return None
        keys = [ProgressBoard.key(self.board, r) for r in range(len(self.labels))]
        outcome = _within(ANSWER_S, store.multi_get, keys)
        if not isinstance(outcome, list):
            self._lost(outcome)
            return None
        beats = {}
        for rank, value in enumerate(outcome):
            count, _, collective = value.decode().partition("|")
            beats[rank] = (int(count), collective)
        return beats

    def _lost(self, err: BaseException) -> None:
        # A read may still hang on its thread: no board may use this connection again.
        if _clients.get(self._address) is self._store:
            del _clients[self._address]
        self._store = None
        self.host_silent = True
        why = "" if isinstance(err, TimeoutError) else f" ({err})"
        self.unreachable = (f"Rank {self.labels[0]} hosts the progress board and did not answer within "
                            f"{ANSWER_S:g} s{why}: it is stopped or hung itself.")

    def stalled(self, before: dict[int, tuple[int, str]] | None, after: dict[int, tuple[int, str]] | None,
                collective: str) -> tuple[list[int] | None, str]:
        """The members (as labels) whose beat did not move between two reads, and what the reads
        tell about every other member; ``None`` when the board could not be read."""
        if before is None or after is None:
            if self.host_silent and self.rank != 0:
                return [self.labels[0]], self.unreachable
            return None, self.unreachable or "The progress board could not be read."
        stalled, waiting_elsewhere = [], []
        for rank in range(len(self.labels)):
            if rank == self.rank:
                continue
            if after[rank][0] == before[rank][0]:
                stalled.append(self.labels[rank])
            elif after[rank][1] != collective:
                waiting_elsewhere.append(f"rank {self.labels[rank]} waits for {after[rank][1]!r}")
        if stalled:
            detail = (f"Rank{'s' if len(stalled) > 1 else ''} {', '.join(map(str, stalled))} showed no sign of "
                      f"waiting in a collective for {self.listen_s:.1f} s: stopped, hung, or busy outside "
                      f"communication (data loading, its own computation).")
        else:
            detail = "Every rank is waiting in a collective, so they wait for different ones."
        if waiting_elsewhere:
            detail += f" Meanwhile {'; '.join(waiting_elsewhere)} (ranks launched different collectives?)."
        return stalled, detail
