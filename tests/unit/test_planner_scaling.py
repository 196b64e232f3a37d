"""``python -m grace_legacy plan`` over worker counts: the wire-volume table (each route alone, the
default bundle's choice and ``communicator="auto"``'s side by side, 4 to 1024 workers), the
alpha-beta link times of ``--bandwidth``/``--latency`` against sums written out here, the units
those flags take, the plot, and issue #36's check on ResNet-50 at 64 workers (QSGD <= 30%,
signSGD <= 8%, with the two-phase route)"""

from __future__ import annotations

import math
import re

import pytest
import torch

from grace_legacy import TopK
from grace_legacy.__main__ import main
from grace_legacy.planner import WORKER_COUNTS, link_time, plan, step_time
from grace_legacy.runtime import wire
from grace_legacy.runtime.cost import bytes_sent

ROW = re.compile(r"\s*(\d+)((?:\s+[\d.]+%)+)\s\s(.+)")
TIME = re.compile(r"(dense|allreduce|allgather|scattergather|default|auto)\s+([\d.e+]+)\s+([\d.e+]+)\s+([\d,]+)"
                  r"\s+([\d.e+-]+)\s+([\d.e+-]+)\s+([\d.e+-]+)(?:\s+[\d.e+-]+)?")
#: A row with ``--compute``: the route, its total link time and its step.
STEP = re.compile(r"(dense|allreduce|allgather|scattergather|default|auto)(?:\s+[\d.e+,-]+){5}\s+([\d.e+-]+)"
                  r"\s+([\d.e+-]+)")


def run(capsys, *argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.strip().splitlines()


def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def volume_of(lines):
    match = re.fullmatch(r"expected volume ([\d.]+)%", lines[-1])
    assert match, lines
    return float(match.group(1)) / 100


def scaling_rows(lines):
    """{workers: (volume per column, the default's routes, auto's routes)} of the wire-volume table."""
    start = lines.index(next(line for line in lines if line.startswith("wire volume by workers")))
    header = lines[start + 1].split()
    assert header[0] == "workers" and header[-7:] == ["default", "auto", "default", "routes", "|", "auto",
                                                      "routes"], header
    rows = {}
    for line in lines[start + 3:]:
        match = ROW.fullmatch(line)
        if not match:
            break
        volumes = [float(v.rstrip("%")) / 100 for v in match.group(2).split()]
        default, auto = match.group(3).split(" | ")
        rows[int(match.group(1))] = (dict(zip(header[1:-5], volumes, strict=True)), default,
                                     default if auto == "same" else auto)
    return rows


def link_times(lines):
    """{route: (collectives, steps, link bytes, latency s, transfer s, total s)} of the estimate."""
    out = {}
    for line in lines:
        match = TIME.fullmatch(line)
        if match:
            out[match.group(1)] = (float(match.group(2)), float(match.group(3)), int(match.group(4).replace(",", "")),
                                   *map(float, match.groups()[4:]))
    return out


def test_the_table_has_every_worker_count_and_the_bundles_routes(capsys):
    lines = run(capsys, "--sizes", "600000,40,100000,8", "--by", "uniform", "--group-compressions", "25",
                "--workers", "32")
    rows = scaling_rows(lines)
    assert sorted(rows) == sorted({*WORKER_COUNTS, 32})
    schedule_shapes = [600000, 40, 100000, 8]
    dense = 4 * sum(schedule_shapes)
    handed = sum(bytes_sent(TopK(0.25), n, torch.float32) for n in schedule_shapes)
    for workers, (volumes, routes, auto_routes) in rows.items():
        # Gathered, each rank receives the P - 1 others' payloads where a ring allreduce moves
        # 2 (P - 1) / P of the dense bytes: P / 2 times the payload's share.
        assert volumes["allgather"] == pytest.approx(workers / 2 * handed / dense, abs=5e-5)
        counts = [int(n) for n in re.findall(r"\b(\d+)(?:,|$)", routes)]
        assert sum(counts) == 4, routes
        assert set(re.findall(r"[a-z-]+", routes)) <= {"dense", "dense-fallback", "allgather"}
        assert set(re.findall(r"[a-z-]+", auto_routes)) <= {"dense", "dense-fallback", "allgather", "scattergather"}
        # The default is the cheaper of the gather and dense; auto never costs more than it.
        assert volumes["default"] == pytest.approx(min(volumes["allgather"], 1.0), abs=5e-5)
        assert volumes["auto"] <= volumes["default"] + 5e-5
    # Scatter-gathered, Top-k 25% (8 bytes an entry) costs about half of dense at any size of
    # shard; the bundle never chooses more than dense.
    assert all(volumes["scattergather"] == pytest.approx(0.5, abs=0.01) for w, (volumes, *_) in rows.items()
               if w <= 256)
    assert all(volumes["auto"] == pytest.approx(0.5, abs=0.01) for w, (volumes, *_) in rows.items() if w <= 256)
    assert volume_of(lines) == pytest.approx(rows[32][0]["default"], abs=5e-5)
    auto_lines = run(capsys, "--sizes", "600000,40,100000,8", "--by", "uniform", "--group-compressions", "25",
                     "--workers", "32", "--communicator", "auto")
    assert volume_of(auto_lines) == pytest.approx(rows[32][0]["auto"], abs=5e-5)


def test_without_workers_the_plan_is_for_four(capsys):
    lines = run(capsys, "--sizes", "600000,40", "--compressor", "qsgd")
    assert lines[0] == ("QSGD(levels=127, seed=0) on 4 workers (the default; --workers N), fused buckets of up "
                        "to 16,777,216 bytes")
    assert volume_of(lines) == pytest.approx(scaling_rows(lines)[4][0]["default"], abs=5e-5)


def test_link_times_are_latency_steps_and_bytes_over_bandwidth(capsys):
    """Three tensors of 1,000 elements, each alone, at 4 workers, 1 MB/s and 1 ms a step; Top-k
    30%: 300 entries of 8 bytes, 75 per shard of 250 elements."""
    lines = run(capsys, "--sizes", "1000,1000,1000", "--bucket-bytes", "0", "--workers", "4",
                "--bandwidth", "8Mbit", "--latency", "1ms")
    times = link_times(lines)
    assert set(times) == {"dense", "allgather", "scattergather", "default", "auto"}
    payload = wire.packed_size_of(TopK(0.3).payload_spec(1000, torch.float32), with_header=False)
    segment = wire.packed_size_of(TopK(0.3).payload_spec(250, torch.float32), with_header=False)
    assert (payload, segment) == (2400, 600)
    expected = {
        # one ring allreduce per tensor: 2 (P - 1) steps, 2 (P - 1) / P of 4,000 bytes
        "dense": (3, 3 * 6, 3 * 1.5 * 4000),
        # one ring allgather per tensor: P - 1 steps, the 3 other ranks' payloads
        "allgather": (3, 3 * 3, 3 * 3 * payload),
        # an all-to-all and an allgather per tensor: 2 (P - 1) steps; 3 of 4 segments out and back
        "scattergather": (6, 3 * 6, 3 * 3 * 2 * segment),
    }
    # Gathered, more than dense: the default sends it dense; "auto" scatter-gathers it.
    expected["default"], expected["auto"] = expected["dense"], expected["scattergather"]
    for route, (collectives, steps, link) in expected.items():
        got = times[route]
        assert got[:3] == (collectives, steps, link), route
        assert got[3] == pytest.approx(1e-3 * steps, rel=1e-3)
        assert got[4] == pytest.approx(link / 1e6, rel=1e-3)
        assert got[5] == pytest.approx(got[3] + got[4], rel=1e-3)
    # Fused into one bucket: one collective of each kind instead of one per tensor.
    fused = link_times(run(capsys, "--sizes", "1000,1000,1000", "--workers", "4", "--bandwidth", "1e6"))
    assert fused["dense"][:2] == (1, 6) and fused["scattergather"][:2] == (2, 6)
    assert fused["dense"][3] == 0  # no --latency: 0 s a step


def test_a_measured_compute_time_gives_each_route_its_step(capsys):
    """``--compute``: each route's step is the compute time then its link time, as ``step_time``
    computes from the plan; without it no step column."""
    argv = ["--sizes", "1000,1000,1000", "--bucket-bytes", "0", "--workers", "4", "--bandwidth", "8Mbit",
            "--latency", "1ms"]
    lines = run(capsys, *argv, "--compute", "25ms")
    header = next(line for line in lines if line.startswith("link time per step"))
    assert header.endswith("; step = 0.025 s of compute, then the link time:")
    steps = {}
    for line in lines:
        match = STEP.fullmatch(line)
        if match:
            steps[match.group(1)] = (float(match.group(2)), float(match.group(3)))
    assert set(steps) == {"dense", "allgather", "scattergather", "default", "auto"}
    for route, (total, step) in steps.items():
        assert step == pytest.approx(0.025 + total, rel=1e-3), route
    shapes = [torch.Size([1000])] * 3
    dense = plan(TopK(0.3), shapes, world_size=4, route="dense", bucket_bytes=0)
    assert steps["dense"][1] == pytest.approx(step_time(dense, 1e6, 1e-3, 0.025), rel=1e-3)
    assert step_time(dense, 1e6, 1e-3, 0.025) == pytest.approx(0.025 + link_time(dense, 1e6, 1e-3).total_s)
    assert not any(STEP.fullmatch(line) for line in run(capsys, *argv))
    assert link_times(run(capsys, *argv)) == link_times(lines)


@pytest.mark.parametrize("compute", [-1.0, math.nan, math.inf, "20ms", None])
def test_step_time_refuses_a_compute_time_that_is_not_seconds(compute):
    with pytest.raises(ValueError, match="step_time: compute must be a finite number of seconds >= 0"):
        step_time(plan(TopK(0.3), [1000], world_size=4), 1e6, 0.0, compute)


def test_an_additive_compressor_is_timed_on_its_allreduce(capsys):
    lines = run(capsys, "--sizes", "1000", "--compressor", "fp16", "--workers", "4", "--bandwidth", "1e6")
    times = link_times(lines)
    assert times["allreduce"][2] == 1.5 * 2000 and times["default"] == times["auto"] == times["allreduce"]
    assert "allreduce" in scaling_rows(lines)[4][0]


@pytest.mark.parametrize(("text", "per_second"), [
    ("100Mbit", 12.5e6), ("10Gbit/s", 1.25e9), ("1.25GB", 1.25e9), ("1e9", 1e9), ("800kbps", 1e5),
    ("2MB/s", 2e6), ("1 Tb", 1.25e11)])
def test_bandwidth_units(capsys, text, per_second):
    lines = run(capsys, "--sizes", "1000", "--bandwidth", text)
    header = next(line for line in lines if line.startswith("link time per step"))
    assert float(re.search(r", ([\d.e+]+) bytes/s per link", header).group(1)) == pytest.approx(per_second)


@pytest.mark.parametrize(("text", "seconds"), [("20us", 2e-5), ("0.5ms", 5e-4), ("1e-5", 1e-5), ("0", 0.0),
                                               ("2s", 2.0), ("300ns", 3e-7)])
def test_latency_units(capsys, text, seconds):
    lines = run(capsys, "--sizes", "1000", "--bandwidth", "1GB", "--latency", text)
    header = next(line for line in lines if line.startswith("link time per step"))
    assert float(re.search(r", ([\d.e+-]+) s per collective step", header).group(1)) == pytest.approx(seconds)


@pytest.mark.parametrize(("argv", "message"), [
    (["--bandwidth", "fast"], "argument --bandwidth: must be a bandwidth > 0"),
    (["--bandwidth", "0Gbit"], "argument --bandwidth: must be a bandwidth > 0"),
    (["--bandwidth=-1Gbit"], "argument --bandwidth: must be a bandwidth > 0"),
    (["--bandwidth", "10Xbit"], "argument --bandwidth: must be a bandwidth > 0"),
    (["--bandwidth", "inf"], "argument --bandwidth: must be a bandwidth > 0"),
    (["--bandwidth", "1Gbit", "--latency=-1us"], "argument --latency: must be a latency >= 0"),
    (["--bandwidth", "1Gbit", "--latency", "soon"], "argument --latency: must be a latency >= 0"),
    (["--bandwidth", "1Gbit", "--latency", "nan"], "argument --latency: must be a latency >= 0"),
    (["--latency", "1us"], "--latency needs --bandwidth"),
    (["--compute", "20ms"], "--compute needs --bandwidth"),
    (["--bandwidth", "1Gbit", "--compute=-1ms"], "argument --compute: must be a time >= 0"),
    (["--bandwidth", "1Gbit", "--compute", "inf"], "argument --compute: must be a time >= 0"),
    (["--bandwidth", "1Gbit", "--compute", "a while"], "argument --compute: must be a time >= 0"),
    (["--bucket-bytes=-1"], "argument --bucket-bytes: must be an integer in [0, 2**63 - 1]"),
])
def test_bad_link_flags_are_named(capsys, argv, message):
    assert message in refused(capsys, "--sizes", "1000", *argv)


def test_plot_draws_volume_against_workers(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "scaling.png"
    lines = run(capsys, "--sizes", "600000,20,100000,5", "--compressor", "signsgd", "--plot", str(path))
    assert f"plot: {path}" in lines
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lines[-1].startswith("expected volume")


def test_plan_refuses_a_route_its_compressor_cannot_take():
    with pytest.raises(ValueError, match="route 'allreduce' sums payloads"):
        plan(TopK(0.1), [100], route="allreduce")
    with pytest.raises(ValueError, match="route must be None, .auto. or one of"):
        plan(TopK(0.1), [100], route="ring")


@pytest.mark.parametrize(("compressor", "ceiling"), [("qsgd", 0.30), ("signsgd", 0.08)])
def test_resnet50_at_64_workers(capsys, compressor, ceiling):
    """Issue #36's check: compression that still pays at 64 workers, with the two-phase route."""
    pytest.importorskip("torchvision")
    lines = run(capsys, "--model", "torchvision:resnet50", "--compressor", compressor, "--workers", "64",
                "--communicator", "auto")
    assert volume_of(lines) <= ceiling
    assert "scattergather" in scaling_rows(lines)[64][2]
