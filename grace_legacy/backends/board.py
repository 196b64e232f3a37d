"""A progress board: which ranks are alive and waiting in a collective, so that a rank whose
collective stalls can name the ranks it waits for.

A stalled collective cannot ask the ranks it waits for anything through the collective library,
which is what is stuck. The board is out of band: a key-value store
(``torch.distributed.TCPStore``) that the process set's first rank hosts in a background thread,
which every member reaches over TCP.

What goes on it, and when: nothing at all while collectives complete within
:data:`BEAT_AFTER_S`. A rank that has waited longer for one collective posts a *beat* (a counter
and the collective's name) every :data:`BEAT_AFTER_S` for as long as it waits. A rank whose
wait reaches the stall timeout reads every member's beat, keeps waiting (and beating) for
:attr:`ProgressBoard.listen_s`, and reads them again: a rank whose counter moved is alive and
waiting too; a rank whose counter did not move is the one being waited for, whether it is
stopped (``SIGSTOP``, a debugger), hung outside the collectives, or still busy with something
else. If the host itself does not answer within :data:`ANSWER_S`, the host is the one that
stopped: a stopped process's store thread stops with it.

So a step whose waits are short costs nothing on the board, a long wait one small message a
second, and naming the stalled ranks two reads of ``P`` keys. A board that posted every rank's
progress every step would name a rank that is a step behind as precisely, for one message per
rank per step to the host, and the waiting ranks' beats tell the same thing as soon as it matters
(``benchmarks/performance/stall.py`` measures both, results in
``benchmarks/results/performance.md``).

The host's address is its host name (``127.0.0.1`` for members on the same host), handed to the
members once when the board opens; a member that cannot reach it within :data:`ANSWER_S` works
without a board, and its stall errors then say that they cannot name the ranks.
"""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed import TCPStore

#: A wait longer than this posts beats, one every this many seconds.
BEAT_AFTER_S = 1.0

#: How long a read of the board, or a member's first connection, may take before the host
#: counts as not answering: a round trip of microseconds, given ample room because a host that is
#: merely slow (a busy machine) must not be named as stopped.
ANSWER_S = 10.0
#: Extra time a first connection's thread is waited for beyond the store's own timeout: the store
#: tries twice, with a random delay between the tries of up to about its timeout.
CONNECT_GRACE_S = 2 * ANSWER_S


def host_address(board: str, members: int) -> tuple[str, int]:
    """Host the board named ``board`` for ``members`` members on this rank, every member's beat
    posted as none; return (host name, port). One store (any free port, every interface) serves
    every board this process hosts, for as long as the process runs."""
    if not _hosted:
        _hosted.append(TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=ANSWER_S),
                                wait_for_workers=False))
    for rank in range(members):
        _hosted[0].set(ProgressBoard.key(board, rank), "0|")
    return socket.gethostname(), _hosted[0].port


# The store this process hosts: it must keep answering after the boards that opened it are gone,
# for as long as other members may read it.
_hosted: list[TCPStore] = []

# Connections to other processes' stores, by address, shared by every board on that store.
_clients: dict[tuple[str, int], TCPStore] = {}


def _within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or the error it raised, or a ``TimeoutError`` if it has not returned after
    ``seconds``. A store client whose host is stopped waits for the answer forever, whatever its
    own timeout says, so the call runs on a daemon thread that is left behind if it never returns
    (the board is not used again then)."""
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
    """One process-set member's view of the board (see the module docstring).

    ``board``: the board's name, the same on every member (one per process set); ``rank``: this
    member's index in the set; ``labels``: how errors name each member (its global rank);
    ``address``: (host name, port) from :func:`host_address` on the set's first member.
    """

    def __init__(self, board: str, rank: int, labels: Sequence[int], address: tuple[str, int],
                 beat_s: float = BEAT_AFTER_S):
        self.board, self.rank, self.labels, self.beat_s = board, rank, list(labels), beat_s
        self.listen_s = 2 * beat_s + 0.5
        self.unreachable: str | None = None
        #: whether the host stopped answering after this member had reached it
        self.host_silent = False
        self._beats = 0
        self._address = address
        host, port = address
        target = "127.0.0.1" if host == socket.gethostname() else host
        self._store: TCPStore | None = _clients.get(address)
        if self._store is None:
            # The thread is given longer than the store's own timeout, so that an unreachable host
            # (another network namespace, a firewall) ends the attempt inside the thread: a thread
            # left in the store's C++ code aborts the process when it exits.
            outcome = _within(ANSWER_S + CONNECT_GRACE_S, TCPStore, target, port, None, False,
                              datetime.timedelta(seconds=ANSWER_S))
            if isinstance(outcome, TCPStore):
                self._store = _clients[address] = outcome
            else:
                self.unreachable = (f"The progress board on rank {self.labels[0]} ({host}:{port}) could not be "
                                    f"reached when it opened ({outcome}).")

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
