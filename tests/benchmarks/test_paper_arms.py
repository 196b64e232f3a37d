"""The rebuttal's tables as arms (``benchmarks/common/paper_arms.py``) and their networks
(``benchmarks/common/resnets.py``): every narrowed layer, 2-D or 1-D, sits in the size group of the
layer it stands for in the rebuttal's full-size network; the 1-D networks keep every downsampling;
the mnist1d tables scale every value of the rebuttal's schedules by the one factor their uniform
arm was scaled by; the digits tables keep the rebuttal's values; and the report's headroom is dense
minus uniform paired by seed, with a t interval computed here apart from the library's."""

import math
import statistics
from fractions import Fraction

import pytest
import torch

from benchmarks.common.paper_arms import TABLES, expected_volume, scale
from benchmarks.common.resnets import ResNet9, ResNet18, counterpart_splits
from grace_legacy import TopK

#: The rebuttal's groups, written out: under 600 elements, under 100k, under 1M, the rest.
BOUNDS = (600, 100_000, 1_000_000)


def group(numel: int, bounds) -> int:
    return sum(numel >= b for b in bounds)


@pytest.mark.parametrize("key", list(TABLES))
def test_every_layer_is_in_its_full_size_counterparts_group(key):
    table = TABLES[key]
    narrow = table.build()
    # The rebuttal's networks: 2-D, full width, CIFAR-10's 10 classes (ResNet-9), CIFAR-100's 100 (ResNet-18).
    full = ResNet9(10, divisor=1, dims=2) if isinstance(narrow, ResNet9) else ResNet18(100, divisor=1, dims=2)
    pairs = list(zip(narrow.named_parameters(), full.named_parameters(), strict=True))
    assert len(pairs) == (25 if isinstance(narrow, ResNet9) else 62)
    for (name, p), (full_name, q) in pairs:
        # The same layer: the same path past the top-level index (the 1-D ResNet-9 has one more pooling).
        assert name.split(".")[2:] == full_name.split(".")[2:] and p.dim() in (q.dim(), q.dim() - 1)
        assert group(p.numel(), table.splits) == group(q.numel(), BOUNDS), name
    # Every group holds some tensor, so every value of a layer schedule is used.
    assert {group(p.numel(), table.splits) for p in narrow.parameters()} == {0, 1, 2, 3}


@pytest.mark.parametrize("cls", [ResNet9, ResNet18])
def test_the_1d_networks_take_40_sample_signals_and_keep_every_downsampling(cls):
    model = cls(divisor=8, dims=1)
    seen = []
    last_conv = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d)][-1]
    last_conv.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    out = model(torch.randn(6, 40))
    assert out.shape == (6, 10)
    assert seen[0][-1] == 5  # 40 -> 20 -> 10 -> 5 positions
    assert not any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def test_no_splits_exist_when_a_narrowed_lower_group_tensor_outgrows_a_higher_one():
    # One channel wide: the last batch norm has 8 elements (its counterpart's group is the smallest)
    # and the second convolution 1 * 2 * 3 = 6 (its counterpart is in the next group).
    with pytest.raises(ValueError, match="no split separates them"):
        counterpart_splits(ResNet9(divisor=64, dims=1))


def test_scale_rounds_to_the_nearest_integer_at_least_one_and_keeps_uncompressed():
    assert scale([64, 32, 16], Fraction(1, 16)) == [4, 2, 1]
    assert scale([None, 256, 64, 16], Fraction(1, 16)) == [None, 16, 4, 1]
    assert scale([6, 4, 3, 2], Fraction(2, 3)) == [4, 3, 2, 1]  # 8/3, 2, 4/3 round to 3, 2, 1
    assert scale([1, 2], Fraction(1, 8)) == [1, 1]
    assert scale([3], Fraction(1, 2)) == [2]                   # a half rounds up


def test_mnist1d_tables_scale_the_rebuttals_values_by_their_uniform_arms_factor():
    qsgd, power = TABLES["mnist1d-qsgd"], TABLES["mnist1d-powersgd"]
    assert qsgd.factor == Fraction(qsgd.reference, 32) and power.factor == Fraction(power.reference, 3)
    assert [a.name for a in qsgd.schedules] == ["LEGACY epoch s=4,2,1", "LEGACY layer s=-,16,4,1"]
    assert qsgd.reference_name == "uniform s=2"
    assert set(qsgd.paper) == {"uniform s=2", "LEGACY epoch s=4,2,1", "LEGACY layer s=-,16,4,1"}
    for table in (qsgd, power):
        assert table.setting.dims == 1 and table.task.data == "mnist1d"


def test_digits_tables_keep_the_rebuttals_values():
    qsgd, power = TABLES["qsgd"], TABLES["powersgd"]
    assert qsgd.factor == power.factor == 1
    assert [a.name for a in qsgd.schedules] == ["LEGACY epoch s=64,32,16", "LEGACY layer s=-,256,64,16"]
    assert [a.name for a in power.schedules] == ["L-GreCo r in 1-8 (ref. 3)", "Accordion r=4/2",
                                                 "LEGACY epoch r=6,4,3,2", "LEGACY layer r=-,8,3,2"]
    assert qsgd.splits == [75, 1562, 15625]


def test_headroom_is_dense_minus_uniform_paired_by_seed():
    from benchmarks.accuracy.paper_tables import headroom

    table = TABLES["mnist1d-powersgd"]
    dense = [0.90, 0.88, 0.91, 0.87, 0.89]
    uniform = [0.84, 0.85, 0.83, 0.84, 0.86]
    runs = [{"arm": arm, "seed": seed, "final": value}
            for arm, values in (("dense", dense), (table.reference_name, uniform)) for seed, value in enumerate(values)]
    room = headroom(table, {"runs": runs})
    differences = [d - u for d, u in zip(dense, uniform, strict=True)]
    t975_4 = 2.7764451051977987  # the 97.5% quantile of Student's t with 4 degrees of freedom
    half = t975_4 * statistics.stdev(differences) / math.sqrt(5)
    assert room.mean == pytest.approx(statistics.fmean(differences))
    assert (room.low, room.high) == (pytest.approx(room.mean - half), pytest.approx(room.mean + half))
    assert room.seeds == 5


@pytest.mark.parametrize("key", ["qsgd", "mnist1d-qsgd"])
def test_the_qsgd_control_is_the_epoch_schedules_top_level_at_the_references_wire_bytes(key):
    from benchmarks.common.paper_arms import matched_uniforms, table_arms

    table = TABLES[key]
    top = scale([64], table.factor)[0]
    assert table.controls == [top]
    matching = matched_uniforms(table, table.build(), 3, 5, 4)
    expected = matching["uniform_expected"]
    assert expected[str(top)] == expected[str(table.reference)]  # int8 levels either way
    names = [arm.name for arm in table_arms(table, matching)]
    assert names[:3] == ["dense", table.reference_name, table.uniform_name(top)]


def test_added_arms_replace_their_earlier_runs_and_must_pair():
    from benchmarks.accuracy.paper_tables import _added

    def run(arm, seed, final):
        return {"arm": arm, "seed": seed, "final": final}

    earlier = {"runs": [run("dense", 0, 0.9), run("uniform s=2", 0, 0.8), run("uniform s=4", 0, 0.1)],
               "epochs": 12, "steps_per_epoch": 15, "matching": {}, "measured": "first."}
    new = {"runs": [run("uniform s=4", 0, 0.85)], "epochs": 12, "steps_per_epoch": 15, "matching": {"m": 1},
           "measured": "second."}
    combined = _added(earlier, new, ["uniform s=4"])
    assert combined["runs"] == [run("dense", 0, 0.9), run("uniform s=2", 0, 0.8), run("uniform s=4", 0, 0.85)]
    assert combined["measured"] == "first. Added by a later launch (uniform s=4): second."
    with pytest.raises(ValueError, match="would not pair"):
        _added(earlier, {**new, "epochs": 2}, ["uniform s=4"])


def test_arms_must_be_a_tables_arms_and_the_table_must_have_earlier_runs(tmp_path):
    import argparse
    import json

    from benchmarks.accuracy.paper_tables import _earlier_tables

    args = argparse.Namespace(results=tmp_path, tables=["mnist1d-qsgd"], arms=["uniform s=4"])
    with pytest.raises(ValueError, match="has none of 'mnist1d-qsgd'"):
        _earlier_tables(args)
    (tmp_path / "paper_tables.json").write_text(json.dumps({"mnist1d-qsgd": {"epochs": 12, "steps_per_epoch": 15}}))
    assert set(_earlier_tables(args)) == {"mnist1d-qsgd"}
    args.arms = ["uniform s=3"]
    with pytest.raises(ValueError, match="not among"):
        _earlier_tables(args)


def test_the_topk_table_puts_legacy_and_whole_model_top_k_at_the_uniform_arms_link_bytes():
    table = TABLES["mnist1d-topk"]
    model = table.build()
    uniform = expected_volume(TopK(table.reference), model, 1, 4, route="allgather")
    for arm in table.schedules:
        compressor = arm.build(None).compressor
        # Solved to three significant figures: within 2% of the uniform arm's link bytes.
        assert abs(expected_volume(compressor, model, 1, 4, route="allgather") / uniform - 1) < 0.02, arm.name
    assert table.comparisons == [tuple(arm.name for arm in table.schedules)]
    assert [arm.build(None).compressor.traits.spans_step for arm in table.schedules] == [False, True]
