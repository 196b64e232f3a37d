"""The rate-limited benchmarks' namespaces: Ctrl-C, SIGTERM and SIGHUP wait for a cluster's
creation or removal to finish (an interrupted ``ip`` command could otherwise make a namespace
after the removal looked for them)."""

import os
import signal

import pytest

from benchmarks.common.netns import DEFERRED_SIGNALS, _signals_deferred


class Delivered(Exception):
    pass


@pytest.fixture
def own_sigterm_handler():
    """SIGTERM handled by raising :class:`Delivered` (whatever disposition the suite inherited)."""
    def handler(signum, frame):
        raise Delivered(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_received_inside_the_block_is_delivered_when_the_block_ends(own_sigterm_handler):
    steps = []
    with pytest.raises(Delivered):
        with _signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            steps.append("the rest of the block ran")
    assert steps == ["the rest of the block ran"]
    assert signal.getsignal(signal.SIGTERM) is own_sigterm_handler


def test_without_a_signal_the_block_leaves_every_handler_as_it_found_it(own_sigterm_handler):
    before = {signum: signal.getsignal(signum) for signum in DEFERRED_SIGNALS}
    with _signals_deferred():
        assert all(signal.getsignal(signum) is not before[signum] for signum in DEFERRED_SIGNALS)
    assert {signum: signal.getsignal(signum) for signum in DEFERRED_SIGNALS} == before
