"""The progress board (``backends/board.py``) on a real store, one process standing in for several
members: a member whose beat does not move is named; a member tries loopback for its own host
name, else the name, then each address; one where nothing listens is given up at once, leaving no
thread; a store without the board is not used; and a stopped host process is named within the
answer time."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from grace_legacy.backends import board as board_module
from grace_legacy.backends.board import BoardAddress, ProgressBoard, host_address
from tests.helpers import free_port


def test_a_member_whose_beat_does_not_move_is_named():
    address = host_address("unit", 3)
    members = [ProgressBoard("unit", rank, [10, 11, 12], address, beat_s=0.05) for rank in range(3)]
    members[1].beat("bucket0")
    before = members[0].read()
    members[1].beat("bucket0")
    stalled, detail = members[0].stalled(before, members[0].read(), "bucket0")
    assert stalled == [12] and "Rank 12 showed no sign" in detail
    before = members[0].read()
    members[1].beat("bucket0")
    members[2].beat("bucket7")
    stalled, detail = members[0].stalled(before, members[0].read(), "bucket0")
    assert stalled == [] and "rank 12 waits for 'bucket7'" in detail


def test_a_member_tries_loopback_for_its_own_host_name_else_the_name_then_each_address():
    assert BoardAddress(socket.gethostname(), 1, ("10.0.0.1", "fd00::1")).candidates() == [
        "127.0.0.1", "10.0.0.1", "fd00::1"]
    assert BoardAddress("elsewhere", 1, ("10.0.0.1",)).candidates() == ["elsewhere", "10.0.0.1"]
    assert BoardAddress.from_text(BoardAddress("h", 5, ("10.0.0.1", "fd00::1")).to_text()) == (
        "h", 5, ("10.0.0.1", "fd00::1"))


def test_a_member_reaches_the_host_at_an_address_when_its_name_leads_nowhere():
    address = host_address("unit", 2)._replace(host="no-such-host.invalid", addresses=("127.0.0.1",))
    member = ProgressBoard("unit", 1, [0, 1], address)
    assert member.unreachable is None
    member.beat("bucket0")
    assert member.read()[1] == (1, "bucket0")


def test_a_board_where_nothing_listens_is_given_up_at_once_and_leaves_no_thread():
    # The store's own client would retry there for about twice its timeout, and abort the process
    # if it was still retrying when the process exited.
    threads = set(threading.enumerate())
    began = time.monotonic()
    member = ProgressBoard("unit", 1, [4, 5], BoardAddress(socket.gethostname(), free_port(), ("127.0.0.1",)))
    assert time.monotonic() - began < 2
    assert "progress board on rank 4" in member.unreachable and "nothing answered at 127.0.0.1" in member.unreachable
    assert member.read() is None and member.stalled(None, None, "b")[0] is None
    assert set(threading.enumerate()) <= threads


def test_a_store_that_does_not_hold_the_board_is_not_used():
    address = host_address("unit", 2)._replace(host="elsewhere.invalid", addresses=("127.0.0.1",))
    member = ProgressBoard("another board", 1, [0, 1], address)
    assert "a store without this board answered" in member.unreachable


HOST = """
import sys, time
from grace_legacy.backends.board import host_address
print(host_address("unit", 2).to_text(), flush=True)
time.sleep(60)
"""


def test_a_stopped_host_is_named_within_the_answer_time(monkeypatch):
    monkeypatch.setattr(board_module, "ANSWER_S", 1.0)
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        member = ProgressBoard("unit", 1, [0, 1], BoardAddress.from_text(host.stdout.readline().strip()))
        assert member.read() == {0: (0, ""), 1: (0, "")}
        os.kill(host.pid, signal.SIGSTOP)
        while Path(f"/proc/{host.pid}/stat").read_text().split(")")[-1].split()[0] != "T":  # delivered
            time.sleep(0.01)
        began = time.monotonic()
        assert member.read() is None
        assert time.monotonic() - began < 5
        stalled, detail = member.stalled(None, None, "bucket0")
        assert stalled == [0] and "Rank 0 hosts the progress board and did not answer" in detail
    finally:
        host.kill()
        host.wait(timeout=30)
