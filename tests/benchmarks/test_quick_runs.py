"""Smoke tests of the benchmark pipelines: each ``--quick`` run completes and writes its files.
They check that the pipelines work, not the numbers (those are measured, not asserted)."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.accuracy import many_workers

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed


def run_module(module: str, results: Path, timeout: float) -> None:
    subprocess.run([sys.executable, "-m", module, "--quick", "--results", str(results)], cwd=REPO, check=True,
                   timeout=timeout)


def test_accuracy_study_quick(tmp_path):
    run_module("benchmarks.accuracy.study", tmp_path, timeout=600)
    text = (tmp_path / "accuracy.md").read_text()
    for task in ("digits", "mnist1d", "charlm"):
        assert f"## {task}" in text
    for picture in ("accuracy_vs_volume.png", "accuracy_curves.png"):
        assert (tmp_path / picture).stat().st_size > 1000
    assert (tmp_path / "accuracy.json").exists()


def test_paper_tables_quick(tmp_path):
    run_module("benchmarks.accuracy.paper_tables", tmp_path, timeout=600)
    text = (tmp_path / "paper_tables.md").read_text()
    for arm in ("uniform s=32", "LEGACY epoch s=64,32,16", "LEGACY layer s=-,256,64,16", "uniform r=3",
                "L-GreCo", "Accordion", "LEGACY epoch r=6,4,3,2", "LEGACY layer r=-,8,3,2",
                "uniform s=2", "LEGACY epoch s=4,2,1", "LEGACY layer s=-,16,4,1"):
        assert f"| {arm}" in text
    for where in ("digits", "mnist1d"):
        assert f"## QSGD, ResNet-9 (rebuttal: CIFAR-10; here: {where})" in text
        assert f"## PowerSGD, ResNet-18 (rebuttal: CIFAR-100; here: {where})" in text
    assert "## Top-k + EF, ResNet-9 (not in the rebuttal; here: mnist1d)" in text
    assert "| whole-model Top-k d=" in text and "**LEGACY layer d=-," in text
    assert text.count("| H | 1,000,000 -") == 5 and text.count("**Headroom** (dense - uniform") == 5
    assert "times 1/16" in text and "within noise" in text
    assert (tmp_path / "paper_tables.png").stat().st_size > 1000
    runs = json.loads((tmp_path / "paper_tables.json").read_text())
    assert set(runs) == {"qsgd", "powersgd", "mnist1d-qsgd", "mnist1d-powersgd", "mnist1d-topk"}
    assert {run["seed"] for result in runs.values() for run in result["runs"]} == {0, 1}


def test_long_run_quick(tmp_path):
    run_module("benchmarks.accuracy.long_run", tmp_path, timeout=600)
    text = (tmp_path / "long_run.md").read_text()
    for arm in ("uniform Top-k", "LEGACY epoch thirds", "LEGACY epoch early", "LEGACY layer", "LEGACY both"):
        assert f"| {arm} |" in text and f"| {arm} + EF |" in text
    assert "**The by-epoch claim" in text
    assert (tmp_path / "long_run.png").stat().st_size > 1000


def test_fusion_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.fusion", tmp_path, timeout=300)
    text = (tmp_path / "performance.md").read_text()
    assert "Fused communication" in text and text.count("Fused, phase by phase") == 2
    assert "by part is" in text and "the same sums bit for bit" in text
    assert (tmp_path / "fusion.png").stat().st_size > 1000


def test_memory_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.memory", tmp_path, timeout=600)
    text = (tmp_path / "memory.md").read_text()
    assert "## Memory over 20 steps" in text and "horovodrun -np 2" in text
    assert (tmp_path / "memory.png").stat().st_size > 1000


def test_throughput_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.throughput", tmp_path, timeout=300)
    text = (tmp_path / "performance.md").read_text()
    assert "Compressor throughput" in text and "TopK 0.001" in text and "PowerSGD" in text
    assert all(f"| {label} |" in text for label in ("GlobalTopK 0.01", "CAT", "AdaComp 50", "VarianceSparsifier 1.0"))
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    assert (tmp_path / "throughput.json").exists()


def test_legacy_overhead_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.legacy_overhead", tmp_path, timeout=300)
    text = (tmp_path / "performance.md").read_text()
    assert "LEGACY overhead" in text
    sent = json.loads((tmp_path / "legacy_overhead.json").read_text())["run"]["bytes_sent"]
    assert len(sent) == 2 and len(set(sent.values())) == 1, "both arms must send the same bytes"


def test_horovod_fast_links_quick(tmp_path):
    run_module("benchmarks.performance.horovod_fast_links", tmp_path, timeout=300)
    text = (tmp_path / "performance.md").read_text()
    assert "## Horovod on a fast link" in text and "- **FP16**: hvd fp16 / grace FP16" in text
    result = json.loads((tmp_path / "horovod_fast_links.json").read_text())
    times = result["run"]["times_s"]
    assert set(times) == {"hvd none", "hvd fp16", "grace FP16"} and result["run"]["ranks"] == 4
    assert all(len(row) == result["steps"] for row in times.values())

def bandwidth_unavailable() -> str | None:
    from benchmarks.common.netns import unavailable_reason

    return unavailable_reason()


def namespaces_named(prefix: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    configs = [p.name for p in Path("/etc/netns").glob("*")] if Path("/etc/netns").is_dir() else []
    return [name for name in names + configs if name.startswith(prefix + "-")]


def test_waiting_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.waiting", tmp_path, timeout=300)
    text = (tmp_path / "performance.md").read_text()
    assert "Waiting for collectives" in text and text.count("the spinning Top-k step takes") == 2
    runs = json.loads((tmp_path / "waiting.json").read_text())["runs"]
    assert [run["workers"] for run in runs] == [4, 2]


def test_stall_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.stall", tmp_path, timeout=300)
    assert "Watching for stalled ranks" in (tmp_path / "performance.md").read_text()
    summary = json.loads((tmp_path / "stall.json").read_text())["run"]["summary"]
    assert set(summary["step_s"]) == {"unwatched", "watched", "watched + post each step"}


def run_on_limited_links(module: str, name: str, section: str, tmp_path: Path, timeout: float) -> dict:
    """Run a rate-limited benchmark's smoke run (skipped where namespaces cannot be made); check
    its report section and plot; return its JSON, after checking that its namespaces are gone."""
    reason = bandwidth_unavailable()
    if reason:
        pytest.skip(reason)
    run_module(module, tmp_path, timeout=timeout)
    assert section in (tmp_path / "performance.md").read_text()
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert namespaces_named(result["namespace_prefix"]) == []
    return result


def test_bandwidth_benchmark_quick(tmp_path):
    result = run_on_limited_links("benchmarks.performance.bandwidth", "bandwidth", "Bandwidth-limited training step",
                                  tmp_path, timeout=400)
    for model in ("resnet", "transformer"):
        for rate in result["summary"][model].values():
            assert set(rate) == {"compute only", "dense", "Top-k", "LEGACY"}
        passes = result["models"][model]["topk_passes_s"]  # the floor's passes, timed on every rank
        assert set(passes) == {"add", "select", "clear", "total"} and min(passes.values()) > 0
        assert passes["total"] >= max(passes["add"], passes["select"], passes["clear"])
        tiny = result["models"][model]["tiny_allgather_s"]  # the last collective's fixed cost, per rate
        assert set(tiny) == set(result["summary"][model]) and min(tiny.values()) > 0
    # The report names the command that reproduces it, without the machine's results path.
    assert "`python -m benchmarks.performance.bandwidth --quick`" in (tmp_path / "performance.md").read_text()


def test_ddp_hooks_benchmark_quick(tmp_path):
    """The DDP hooks benchmark's smoke run over torch.distributed workers on rate-limited links:
    every way at every rate, bytes handed to the collectives, the ratios and the verdicts computed,
    and its namespaces gone afterwards."""
    result = run_on_limited_links("benchmarks.performance.ddp_hooks", "ddp_hooks",
                                  "DDP communication hooks, bandwidth-limited", tmp_path, timeout=300)
    ways = {"compute only", "allreduce", "torch fp16", "grace FP16", "torch PowerSGD", "grace PowerSGD",
            "grace Top-k + EF"}
    summary = result["summary"]
    for model in ("resnet", "transformer"):
        assert result["models"][model]["torch_powersgd_buckets"] == 1
        assert set(summary["local_cost_s"][model]) == ways
        for rate in summary["table"][model].values():
            assert set(rate) == ways
            for name, row in rate.items():
                assert row["step_s"] > 0 and row["vs_bound"] > 0 and row["speedup_vs_allreduce"] > 0
                if name != "compute only":
                    assert row["payload_bytes"] > 0 and row["wire_bytes"] > 0 and row["link_bytes"] > 0
        for pair in summary["powersgd"][model].values():
            assert pair["equal_bytes"] and pair["step_ratio"] > 0
    assert len(summary["verdicts"]) == 3


def test_cluster_removes_a_namespace_that_creation_never_recorded():
    """Ctrl-C can interrupt ``subprocess.run`` after ``ip netns add`` made a namespace but before
    the cluster hears of it (CI once left one behind that way): removal goes by name."""
    from benchmarks.common.netns import Cluster

    reason = bandwidth_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(2)
    subprocess.run(["ip", "netns", "add", cluster.namespace(1)], check=True)
    try:
        cluster.remove()
    finally:
        leftover = namespaces_named(cluster.prefix)
        for name in leftover:
            subprocess.run(["ip", "netns", "del", name])
    assert leftover == []


def test_bandwidth_benchmark_removes_its_namespaces_on_ctrl_c(tmp_path):
    import signal
    import time

    reason = bandwidth_unavailable()
    if reason:
        pytest.skip(reason)
    # A suite started as a background job of a script inherits SIGINT ignored, and Python keeps an
    # ignored SIGINT ignored: the benchmark gets it back, as a user's Ctrl-C would find it.
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.performance.bandwidth", "--quick", "--results",
                             str(tmp_path)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    prefix = f"glbw{proc.pid}"
    # The cluster's first worker namespace, not any of the prefix: the benchmark's probe of whether
    # namespaces work here comes and goes under the same prefix before the cluster is made.
    first_worker = f"{prefix}-w0"
    try:
        deadline = time.monotonic() + 300
        while first_worker not in namespaces_named(prefix) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first_worker in namespaces_named(prefix), \
            f"the benchmark never made its namespaces (exit status {proc.poll()})"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert namespaces_named(prefix) == []


def test_variable_gather_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.variable_gather", tmp_path, timeout=300)
    text = (tmp_path / "variable_gather.md").read_text()
    assert "padded vs exact" in text and "two empty, two 1 MiB" in text
    assert (tmp_path / "variable_gather.json").exists()


def test_many_workers_study_quick(tmp_path):
    run_module("benchmarks.accuracy.many_workers", tmp_path, timeout=600)
    text = (tmp_path / "many_workers.md").read_text()
    assert "## The 100-worker sentence" in text and "**Headroom** at 8 workers" in text
    for arm in ("dense", "uniform Top-0.1% + EF", "LEGACY layer + EF", "QSGD s=2 two-phase"):
        assert f"| {arm} |" in text
    assert "### 4 workers" in text and "### 8 workers" in text and "## Gathered against two-phase" in text
    first = json.loads((tmp_path / "many_workers.json").read_text())
    runs = first["runs"]
    assert {(r["workers"], r["seed"]) for r in runs} == {(w, s) for w in (4, 8) for s in (0, 1)}
    assert (tmp_path / "many_workers.png").stat().st_size > 1000
    # A second launch resumes from the JSON: nothing left to run, nothing changed (in process: no
    # second start-up of torch, the data and the plots).
    threads = torch.get_num_threads()
    try:
        again = many_workers.run(argparse.Namespace(quick=True, workers=list(many_workers.QUICK_WORKERS), arms=None,
                                                    seeds=many_workers.QUICK_SEEDS, results=tmp_path))
    finally:
        torch.set_num_threads(threads)
    assert again == first


def test_simulate_step_benchmark_quick(tmp_path):
    run_module("benchmarks.performance.simulate_step", tmp_path, timeout=300)
    text = (tmp_path / "performance.md").read_text()
    assert "A simulated step: W workers against one worker's step" in text and "| 8 | 2 |" in text
    assert (tmp_path / "simulate_step.png").stat().st_size > 1000


def test_time_to_accuracy_quick(tmp_path):
    """The time-to-accuracy smoke run: 2 Horovod workers on 100 Mbit/s links, its three arms timed
    and trained (one seed), each run appended to the JSON; run again, it launches nothing and keeps
    what was measured."""
    from benchmarks.common.time_to_accuracy_arms import QUICK_ARMS

    reason = bandwidth_unavailable()
    if reason:
        pytest.skip(reason)
    run_module("benchmarks.accuracy.time_to_accuracy", tmp_path, timeout=300)
    results = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert sorted(run["arm"] for run in results["runs"]) == sorted(QUICK_ARMS)
    assert [set(t["ways"]) for t in results["timings"]] == [{"compute only", *QUICK_ARMS}]
    assert results["parts"][0]["code"] not in ("", "unknown")  # the commit the runs' code was at
    for run in results["runs"]:
        assert run["workers"] == 2 and run["steps"] == run["budget_steps"] and run["link_bytes_per_step"] > 0
        assert [point[0] for point in run["curve"]][0] == 0 and len(run["curve"]) >= 3
    text = (tmp_path / "time_to_accuracy.md").read_text()
    for arm in QUICK_ARMS:
        assert f"| {arm} | real | " in text
    assert "### 2 workers, 100 Mbit/s" in text and "## The planner's ranking" in text and "Status: complete" in text
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 1000
    run_module("benchmarks.accuracy.time_to_accuracy", tmp_path, timeout=120)
    again = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert again["runs"] == results["runs"] and again["parts"][-1]["launches"] == []
