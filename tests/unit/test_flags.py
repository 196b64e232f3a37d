"""LEGACY's reference flags (``schedules/flags.py``): ``Legacy.from_flags`` reads the authors'
``--group_compressions``/``--group_splits`` (densities in percent, ``none`` or ``100`` dense,
``;`` between phases) into the table the keyword form builds, ``to_flags`` writes them back, a
uniform schedule takes the first value, and bad text is refused naming the flag."""

import pytest

from grace_legacy import Legacy, TopK


@pytest.mark.parametrize("by,text,splits,epochs,expected", [
    ("layer", "100,1,0.1", "10000,1000000", None, [1.0, 0.01, 0.001]),
    ("epoch", "1,0.5,0.1", "", 90, [0.01, 0.005, 0.001]),
    ("both", "100,1;100,0.1", "10000", 90, [[1.0, 0.01], [1.0, 0.001]]),
    ("layer", "none,0.1", "600", None, [None, 0.001]),
])
def test_from_strings_reads_the_reference_format_and_round_trips(by, text, splits, epochs, expected):
    schedule = Legacy.from_flags(TopK(), by, group_compressions=text, group_splits=splits, epochs=epochs)
    table = schedule.table if by == "both" else ([r[0] for r in schedule.table] if by == "epoch" else schedule.table[0])
    assert table == expected
    again = Legacy.from_flags(TopK(), **schedule.to_flags())
    assert again.table == schedule.table and again.splits == schedule.splits and again.epochs == schedule.epochs


def test_from_strings_uniform_uses_the_first_value():
    schedule = Legacy.from_flags(TopK(), "uniform", group_compressions="0.1,5", group_splits="100")
    assert schedule.value_at(10) == schedule.value_at(10**7) == 0.001


@pytest.mark.parametrize("text", ["1,abc", "", "1;2"])
def test_from_strings_rejects_bad_text(text):
    with pytest.raises(ValueError, match="group_compressions"):
        Legacy.from_flags(TopK(), "layer", group_compressions=text, group_splits="")
