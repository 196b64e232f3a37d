"""The consistency check's description, digest and diff logic, and its exchange between threads
standing in for ranks (the real ``horovodrun`` runs are in tests/distributed/test_faults.py)."""

import pytest

from grace_legacy import Grace, Legacy, RanksDisagree, TopK
from grace_legacy.consistency import describe_differences, description_digest, verify_ranks_agree
from tests.helpers import run_ranks

BASE = {"compressor": "TopK(0.01)", "parameters": ["fc.bias[5] float32", "fc.weight[5, 4] float32"]}


def with_item(key, value):
    return {**BASE, key: value}


def test_digest_is_stable_and_ignores_item_order():
    assert description_digest(BASE) == description_digest(dict(reversed(list(BASE.items()))))
    assert description_digest(BASE) == description_digest({**BASE, "parameters": tuple(BASE["parameters"])})
    assert description_digest(BASE) != description_digest(with_item("compressor", "TopK(0.02)"))
    assert 0 <= description_digest(BASE) < 2**63


def test_agreeing_ranks_have_no_differences():
    assert describe_differences([BASE] * 4) == []


def test_text_item_names_every_variant_and_its_ranks_most_common_first():
    lines = describe_differences([BASE, BASE, with_item("compressor", "TopK(0.5)"), BASE])
    assert lines == ["  compressor: ranks 0, 1, 3: TopK(0.01); rank 2: TopK(0.5)"]


def test_a_tie_puts_the_lowest_rank_first():
    lines = describe_differences([with_item("op", "Sum"), with_item("op", "Average")])
    assert lines == ["  op: rank 0: Sum; rank 1: Average"]


def test_list_item_shows_the_entries_a_rank_adds_and_lacks():
    extra = [*BASE["parameters"], "extra.bias[3] float32", "extra.weight[3, 5] float32"]
    reshaped = ["fc.bias[5] float32", "fc.weight[6, 4] float32"]
    lines = describe_differences([BASE, with_item("parameters", extra), BASE, with_item("parameters", reshaped)])
    assert lines == [
        "  parameters: ranks 0, 2: 2 entries; "
        "rank 1: 4 entries, has extra.bias[3] float32, extra.weight[3, 5] float32 that ranks 0, 2 lack; "
        "rank 3: 2 entries, has fc.weight[6, 4] float32 that ranks 0, 2 lack, lacks fc.weight[5, 4] float32"]


def test_long_lists_of_entries_are_summarized():
    many = [f"layer{i}.weight[2] float32" for i in range(10)]
    (line,) = describe_differences([with_item("parameters", []), with_item("parameters", many)])
    assert "layer3.weight[2] float32 and 6 more that rank 0 lack" in line


def test_same_entries_in_another_order():
    (line,) = describe_differences([with_item("buckets", ["a", "b"]), with_item("buckets", ["b", "a"])])
    assert line.endswith("rank 1: 2 entries, the same entries in another order")


def test_missing_item_and_labels_of_a_process_set():
    only_base = dict(BASE)
    lines = describe_differences([with_item("schedule", "epoch 1"), only_base], rank_labels=[1, 3])
    assert lines == ["  schedule: rank 1: epoch 1; rank 3: <missing>"]
    with pytest.raises(ValueError, match="rank_labels"):
        describe_differences([BASE, BASE], rank_labels=[0])


def test_every_rank_raises_the_same_error_even_with_different_numbers_of_parameters():
    def body(backend):
        parameters = BASE["parameters"] + (["extra.weight[3] float32"] * backend.rank())
        try:
            verify_ranks_agree(backend, with_item("parameters", parameters))
        except RanksDisagree as err:
            return str(err)
        return None

    messages = run_ranks(3, body)
    assert messages[0] is not None and len(set(messages)) == 1
    assert "rank 0: 2 entries" in messages[0] and "ranks 1, 2" not in messages[0]
    assert "every rank raises this" in messages[0]


def test_agreeing_ranks_exchange_one_tiny_allgather():
    def body(backend):
        verify_ranks_agree(backend, BASE)
        return list(backend.calls)

    assert run_ranks(4, body) == [[("allgather", 16)]] * 4


def test_a_different_legacy_schedule_changes_the_bundles_description():
    def describe(splits):
        return Grace(Legacy(TopK(), by="layer", values=[1.0, 0.01], splits=splits)).describe()

    (line,) = describe_differences([describe([100]), describe([200])])
    assert line.startswith("  compressor:") and "splits=[100]" in line and "splits=[200]" in line


def test_seeds_are_part_of_the_description_also_inside_schedules():
    # Ranks with different seeds would draw different indices or projections: a silent divergence.
    from grace_legacy import PowerSGD, RandomK

    def describe(compressor):
        return Grace(compressor).describe()

    (line,) = describe_differences([describe(RandomK(0.1, seed=7)), describe(RandomK(0.1, seed=8))])
    assert "seed=7" in line and "seed=8" in line
    (line,) = describe_differences([describe(Legacy(PowerSGD(seed=s), by="layer", values=[1, 2], splits=[10]))
                                    for s in (0, 1)])
    assert "seed=0" in line and "seed=1" in line
