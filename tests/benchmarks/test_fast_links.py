"""The fast-link benchmark (``benchmarks/performance/fast_links.py``): its quick run completes with
four real torchrun ranks and writes its table and plot; its per-part profile puts each piece of
grace_legacy's code in the part it names. The numbers are measured, not asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.performance.fast_links import PAIRS, WAYS, part_of

REPO = Path(__file__).resolve().parents[2]


def test_each_part_of_the_hook_is_named_by_where_the_code_lives():
    root = os.sep.join(("", "src", "grace_legacy", ""))
    assert part_of(root + "ddp.py", "exchange") == "hook entry and exit"
    assert part_of(root + "step_guard.py", "watch") == "non-finite checks"
    assert part_of(root + "grace.py", "start") == "bundle (per-tensor bookkeeping)"
    assert part_of(root + os.path.join("backends", "torch_distributed.py"), "wait") == "collective wait"
    assert part_of(root + os.path.join("backends", "torch_distributed.py"), "_issue") == "collective launch"
    assert part_of(root + os.path.join("compressors", "dense.py"), "decompress") == "decompress"
    assert part_of(root + os.path.join("compressors", "powersgd.py"), "compress") == "compress"
    assert part_of(root + os.path.join("communicators", "exchange.py"), "_launch") == \
        "fusion (pack, concatenate, split)"
    assert part_of(os.sep.join(("", "torch", "nn", "parallel", "distributed.py")), "forward") is None


@pytest.mark.distributed
def test_fast_links_quick(tmp_path):
    # One shape launched (each costs a launch and a profile); every shape is built and run below.
    subprocess.run([sys.executable, "-m", "benchmarks.performance.fast_links", "--quick", "--models", "fc",
                    "--results", str(tmp_path)], cwd=REPO, check=True, timeout=600)
    text = (tmp_path / "performance.md").read_text()
    assert "## DDP hooks on a fast link" in text and "`uptime` before:" in text
    assert "### fc:" in text and "### conv:" not in text
    result = json.loads((tmp_path / "fast_links.json").read_text())
    assert set(result["models"]) == {"fc"} and result["workers"] == 4
    for shape, run in result["models"].items():
        assert set(run["times_s"]) == set(WAYS), shape
        assert all(len(times) == result["steps"] for times in run["times_s"].values())
        assert set(run["ratios"]) == set(PAIRS)
        # PyTorch's hook at its defaults and matched are both timed, and named apart in the report.
        assert {"torch PowerSGD at defaults", "torch PowerSGD matched"} <= set(run["times_s"])
        # Every way was profiled; the hooks' own parts add up to something.
        assert set(run["profile"]["ops"]) == set(WAYS)
        # At its defaults PyTorch's hook factors (past its warm-up: batched products; its later
        # allreduces start from future callbacks, which the profiler may not see); in its warm-up
        # it is one plain allreduce.
        ops = run["profile"]["ops"]
        assert ops["torch PowerSGD at defaults"].get("aten::bmm", 0) > 0
        assert "aten::bmm" not in ops["torch PowerSGD at defaults, warm-up"]
        assert ops["torch PowerSGD at defaults, warm-up"]["c10d::allreduce_"] == 1
        assert all(sum(parts.values()) > 0 for parts in run["profile"]["parts_s"].values())
    for pair in PAIRS:
        assert f"- **{pair}**:" in text
    assert (tmp_path / "fast_links.png").stat().st_size > 1000


def test_the_model_shapes_are_the_ones_the_report_names():
    from benchmarks.performance.fast_links import MODELS, build_model

    for shape in MODELS:
        model, inputs, targets = build_model(shape, quick=True, data_seed=0)
        out = model(inputs)
        assert out.shape[:-1] == targets.shape, shape
    largest = max(p.numel() for p in build_model("fc", quick=False, data_seed=0)[0].parameters())
    assert largest == 4096 * 512  # the fully connected layer the comparison is about
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("vgg", quick=True, data_seed=0)
