"""The stall timeout (``runtime/stall.py``): taken from the argument, then the environment, then
the default, each refused by name when bad; and ``RanksStalled``'s message, which names the
gradient, its bucket and the ranks waited for. The progress board is in ``test_board.py``."""

import pytest

from grace_legacy import Grace, RanksStalled, TopK
from grace_legacy.runtime.stall import DEFAULT_STALL_TIMEOUT_S, STALL_TIMEOUT_ENV, resolve_stall_timeout


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
