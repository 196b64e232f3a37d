"""``python -m grace_legacy plan``: a table per phase and size group and a last line ``expected
volume X%`` computed with the library's byte formula and route choice; budgets, the dense fallback,
models named as ``package.module:function``, the plot, and precise errors for flags that do not fit.
(Link bytes against a real bundle's, the scaling table and the link times: test_planner_wire.py,
test_planner_scaling.py.)"""

import re
import sys
import types

import pytest
import torch
from torch import nn

from grace_legacy import GlobalTopK, Legacy, TopK
from grace_legacy.__main__ import main
from grace_legacy.planner import model_shapes, plan
from grace_legacy.runtime.cost import choose_route, route_link_bytes


def run(capsys, *argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.strip().splitlines()


def volume_of(lines):
    match = re.fullmatch(r"expected volume ([\d.]+)%", lines[-1])
    assert match, lines
    return float(match.group(1)) / 100


def test_layer_schedule_table_and_volume(capsys):
    lines = run(capsys, "--sizes", "600,20,100,5", "--by", "layer", "--group-compressions", "100,10",
                "--group-splits", "50", "--workers", "2")
    # At 2 workers a ring allreduce puts the dense bytes on the link, a gather the other rank's
    # payload. Dense: 20 + 5 elements (100 bytes); Top-k 10%: 60 and 10 entries of 8 bytes (560 of 2800).
    assert volume_of(lines) == pytest.approx((100 + 560) / 2900, abs=5e-5)
    rows = [line for line in lines if line.startswith("all ")]
    assert re.search(r"< 50\s+2\s+25\s+1 \(100%\)\s+100\s+100\s+100\.00%", rows[0]), rows
    assert re.search(r">= 50\s+2\s+700\s+0\.1 \(10%\)\s+560\s+2,800\s+20\.00%", rows[1]), rows


def test_phases_are_weighted_by_their_share_of_the_run(capsys):
    # At 4 workers a gathered Top-k payload (8 bytes an entry) costs P / 2 = 2 times its share of
    # the dense bytes: 40% at density 10%, 4% at 1%; scatter-gathered, about 2 (P - 1) / P of it.
    lines = run(capsys, "--sizes", "100000", "--by", "epoch", "--group-compressions", "10,1,1,1", "--epochs", "8")
    assert volume_of(lines) == pytest.approx((0.4 + 0.04 * 3) / 4, abs=5e-5)
    assert sum(line.startswith("epochs 0 - 2 ") for line in lines) == 2
    auto = run(capsys, "--sizes", "100000", "--by", "epoch", "--group-compressions", "10,1,1,1", "--epochs", "8",
               "--communicator", "auto")
    assert volume_of(auto) == pytest.approx((0.2 + 0.02 * 3) / 4, abs=5e-5)


def test_plan_is_the_library_byte_formula():
    """Tensors alone (no fused buckets): each takes the bundle's route (the default's, or the
    fewest link bytes of the cost model with "auto"), and costs what the model says."""
    schedule = Legacy(TopK(), by="both", values=[[1.0, 0.1], [0.5, 0.01]], splits=[1000], epochs=4)
    shapes = [torch.Size([64, 3, 3, 3]), torch.Size([64]), torch.Size([1000, 512]), torch.Size([1000])]
    for route in (None, "auto"):
        result = plan(schedule, shapes, world_size=8, bucket_bytes=0, route=route)
        check_byte_formula(schedule, shapes, result, route == "auto")


def check_byte_formula(schedule, shapes, result, byte_optimal):
    for phase in range(2):
        expected = 0.0
        for s in shapes:
            concrete = schedule.configured(schedule.table[phase][schedule.group_of(s.numel())])
            if concrete is None:
                expected += 2 * 7 / 8 * s.numel() * 4
                continue
            route = choose_route(concrete, s, torch.float32, 8, byte_optimal=byte_optimal)
            expected += route_link_bytes(concrete, s, torch.float32, 8)[route]
        assert result.phase_totals(phase)[0] == pytest.approx(expected, rel=1e-12)
    dense = 2 * 7 / 8 * sum(s.numel() * 4 for s in shapes)
    assert result.volume == pytest.approx((result.phase_totals(0)[0] + result.phase_totals(1)[0]) / 2 / dense)


def test_dense_fallback_is_counted_and_marked(capsys):
    # Top-k 70% of 1,000 elements at 4 workers: gathered, 3 x 5,600 bytes; scatter-gathered, 3/4 of
    # 4 shards' two payloads of 175 entries (8 bytes each), 8,400; a ring allreduce 1.5 x 4,000.
    fallback = run(capsys, "--sizes", "1000", "--by", "uniform", "--group-compressions", "70", "--workers", "4")
    assert volume_of(fallback) == 1.0
    assert any(line.startswith("* dense-fallback: sent dense") for line in fallback)
    # Top-k 40%: gathered, 3 x 3,200 > 6,000, dense; scatter-gathered ("auto"),
    # 3/4 x 4 x 2 x 800 = 4,800 of 6,000.
    assert volume_of(run(capsys, "--sizes", "1000", "--by", "uniform", "--group-compressions", "40")) == 1.0
    compressed = run(capsys, "--sizes", "1000", "--by", "uniform", "--group-compressions", "40",
                     "--communicator", "auto")
    assert volume_of(compressed) == pytest.approx(0.8)
    assert not any(line.startswith("*") for line in compressed)


def test_budget_matches_the_uniform_volume(capsys):
    sizes = "600000,20000,512,64,10"
    uniform = volume_of(run(capsys, "--sizes", sizes, "--by", "uniform", "--group-compressions", "1"))
    matched = run(capsys, "--sizes", sizes, "--budget", "1", "--by", "both", "--group-splits", "1000",
                  "--layer-factors", "10,1", "--phase-factors", "2,1,0.5", "--epochs", "9")
    assert volume_of(matched) == pytest.approx(uniform, rel=0.01)
    assert any(line.startswith("reference flags: --by 'both'") for line in matched)


def test_no_schedule_uses_gracess_default_parameter(capsys):
    lines = run(capsys, "--sizes", "1000", "--compressor", "qsgd")
    assert lines[0].startswith("QSGD(levels=127, seed=0) on 4 workers (the default")
    # GRACE's compress_ratio 0.3, 8 bytes per entry: gathered at 4 workers more than dense;
    # scatter-gathered about 2 x 0.3 of it.
    assert volume_of(run(capsys, "--sizes", "1000", "--compressor", "topk")) == 1.0
    lines = run(capsys, "--sizes", "1000", "--compressor", "topk", "--communicator", "auto")
    assert volume_of(lines) == pytest.approx(0.6)


def test_model_given_as_module_function(capsys, monkeypatch):
    module = types.ModuleType("planner_test_models")
    module.small = lambda: nn.Sequential(nn.Linear(100, 50), nn.Linear(50, 2))
    monkeypatch.setitem(sys.modules, "planner_test_models", module)
    assert [shape for _, shape in model_shapes("planner_test_models:small")] == [
        torch.Size([50, 100]), torch.Size([50]), torch.Size([2, 50]), torch.Size([2])]
    lines = run(capsys, "--model", "planner_test_models:small", "--by", "layer", "--group-compressions", "100,1",
                "--group-splits", "1000", "--workers", "2")
    assert volume_of(lines) == pytest.approx((152 * 4 + 50 * 8) / (5152 * 4), abs=5e-5)


def test_resnet50_from_torchvision():
    pytest.importorskip("torchvision")
    shapes = model_shapes("torchvision:resnet50")
    assert len(shapes) == 161
    assert sum(s.numel() for _, s in shapes) == 25_557_032


def test_plot_is_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    lines = run(capsys, "--sizes", "600000,20,100000,5", "--by", "both", "--group-compressions", "10,1;1,0.1",
                "--group-splits", "1000", "--epochs", "10", "--plot", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lines[-1].startswith("expected volume")


@pytest.mark.parametrize(("argv", "message"), [
    (["--sizes", "10", "--group-compressions", "1", "--budget", "1"], "not both"),
    (["--sizes", "10", "--by", "layer"], "--by describes a LEGACY schedule"),
    (["--sizes", "10", "--compressor", "signsgd", "--by", "layer", "--group-compressions", "1"],
     "no parameter to schedule"),
    (["--sizes", "10", "--compressor", "threshold"], "cannot be planned"),
    (["--sizes", "10,x"], "argument --sizes: must be comma-separated tensor sizes"),
    (["--model", "resnet50"], "'torchvision:NAME' or 'package.module:function'"),
    (["--model", "torch.nn:NoSuchModel"], "has no function 'NoSuchModel'"),
    (["--sizes", "10", "--budget", "1", "--by", "uniform"], "--budget needs --by layer, epoch or both"),
    (["--sizes", "10", "--workers", "0"], "argument --workers: must be an integer in [1, 2**63 - 1]"),
    (["--sizes", "10", "--by", "layer", "--group-compressions", "1,1"],
     "--group-compressions '1,1': each phase needs 1 value(s), one per size group"),
])
def test_flags_that_do_not_fit_are_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_whole_step_compressor_is_planned_on_the_tensors_end_to_end():
    shapes = [600, 20, 100, 5000]
    for world_size in (2, 8):
        whole = plan(GlobalTopK(0.01), shapes, world_size=world_size)
        one = plan(TopK(0.01), [5720], world_size=world_size)
        assert whole.rank_link_bytes(0) == one.rank_link_bytes(0) and whole.volume == one.volume
    by_epoch = plan(Legacy(GlobalTopK(), by="epoch", values=[1.0, 0.01], epochs=2), shapes)
    assert [sum(t.numel for t in phase) for phase in by_epoch.tensors] == [5720, 5720]
