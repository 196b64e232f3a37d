"""The stall timeout's sources and checks, the error's message, and the progress board's verdicts
(on a real store, one process standing in for several members, and a stopped host process)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grace_legacy import Grace, RanksStalled, TopK
from grace_legacy.backends import board as board_module
from grace_legacy.backends.board import BoardAddress, ProgressBoard, host_address
from grace_legacy.runtime.stall import DEFAULT_STALL_TIMEOUT_S, STALL_TIMEOUT_ENV, resolve_stall_timeout
from tests.helpers import free_port


def test_the_timeout_comes_from_the_argument_then_the_environment_then_the_default(monkeypatch):
    monkeypatch.delenv(STALL_TIMEOUT_ENV, raising=False)
    assert resolve_stall_timeout() == DEFAULT_STALL_TIMEOUT_S == 1800
    monkeypatch.setenv(STALL_TIMEOUT_ENV, "7.5")
    assert resolve_stall_timeout() == 7.5
    assert resolve_stall_timeout(2) == 2.0
    assert Grace(TopK(0.1)).stall_timeout == 7.5
    assert Grace(TopK(0.1), stall_timeout=4).stall_timeout == 4.0


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "3"])
def test_a_bad_argument_is_refused_by_name(value):
    with pytest.raises(ValueError, match="stall_timeout must be a finite number of seconds > 0"):
        Grace(TopK(0.1), stall_timeout=value)


@pytest.mark.parametrize("setting", ["soon", "0", "-3", "inf"])
def test_a_bad_environment_variable_is_refused_by_name(monkeypatch, setting):
    monkeypatch.setenv(STALL_TIMEOUT_ENV, setting)
    with pytest.raises(ValueError, match=STALL_TIMEOUT_ENV):
        Grace(TopK(0.1))


def test_the_message_names_the_gradient_its_bucket_and_the_ranks():
    err = RanksStalled(0, "grace.bucket0.r0.0", 12.34, [2], "Rank 2 showed no sign.").carrying(["b", "a", "c"])
    text = str(err)
    assert text.startswith("rank 0 waited 12.3 s for the gradient of 'b' (collective 'grace.bucket0.r0.0', "
                           "fused with 'a', 'c'); it waits for rank 2. Rank 2 showed no sign.")
    assert STALL_TIMEOUT_ENV in text and err.stalled_ranks == [2] and err.tensors == ["b", "a", "c"]
    assert "could not tell which ranks" in str(RanksStalled(1, "x", 1.0, None, ""))
    assert "every other rank is waiting too" in str(RanksStalled(1, "x", 1.0, [], ""))


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
