"""The stall timeout's sources and checks, the error's message, and the progress board's verdicts
(on a real store, one process standing in for several members, and a stopped host process)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grace_legacy import Grace, RanksStalled, TopK
from grace_legacy.backends import board as board_module
from grace_legacy.backends.board import ProgressBoard, host_address
from grace_legacy.core.stall import DEFAULT_STALL_TIMEOUT_S, STALL_TIMEOUT_ENV, resolve_stall_timeout


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


HOST = """
import sys, time
from grace_legacy.backends.board import host_address
print("%s:%d" % host_address("unit", 2), flush=True)
time.sleep(60)
"""


def test_a_stopped_host_is_named_within_the_answer_time(monkeypatch):
    monkeypatch.setattr(board_module, "ANSWER_S", 1.0)
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        name, _, port = host.stdout.readline().strip().rpartition(":")
        member = ProgressBoard("unit", 1, [0, 1], (name, int(port)))
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
