"""The time-to-accuracy benchmark's statistics, report and resuming, on made-up runs whose answers
are worked out by hand: the target from the dense runs, the time and steps to it, medians that
never invent a time for a run that did not reach it, projections from step timing, the issue's
verdicts and the planner's ranking (``benchmarks/common/time_to_accuracy_*.py``)."""

import json

import pytest

from benchmarks.accuracy import time_to_accuracy as driver
from benchmarks.common.time_to_accuracy_analysis import (
    FLOOR_RATE,
    cells,
    claims,
    compute_share,
    first_timings,
    median_or_none,
    planner_check,
    planner_checks,
    reached,
    speedups,
    stops_paying,
    targets,
    validation,
)
from benchmarks.common.time_to_accuracy_arms import (
    ARMS,
    QUICK_WIDTHS,
    WIDTHS,
    equal_bytes_density,
    shapes_of,
    wide_mlp,
)
from benchmarks.common.time_to_accuracy_report import _claim_lines, _planner_lines, _validation_lines, write_report
from benchmarks.common.time_to_accuracy_worker import append_result, load_results, run_key

RATE = 1e8


def run(arm, seed, curve, workers=8, rate=RATE, stopped_by="budget"):
    """A run record as the workers write it; ``curve``: (step, clock s, accuracy) rows."""
    steps = curve[-1][0]
    return {"key": run_key(ARMS[arm].framework, workers, rate, arm, seed), "arm": arm, "framework": ARMS[arm].framework,
            "seed": seed, "workers": workers, "rate": rate, "curve": [list(p) for p in curve], "steps": steps,
            "budget_steps": steps, "stopped_by": stopped_by, "train_s": curve[-1][1], "link_bytes_per_step": 1e6,
            "load_average": [0.5, 0.5]}


def dense(seed, final, workers=8, rate=RATE, step_s=1.0):
    """A dense run: 0.5 at step 10, then ``final`` at steps 20, 30 and 40."""
    return run("dense fp32", seed, [(0, 0, 0.1), (10, 10 * step_s, 0.5), (20, 20 * step_s, final),
                                    (30, 30 * step_s, final), (40, 40 * step_s, final)], workers, rate)


def timing(framework, workers, rate, steps):
    """A step timing with every way's steps (``steps``: way -> seconds, the same every iteration)."""
    ways = {name: {"iteration": [0, 1, 2], "step_s": [s, s, s], "link_bytes": [2e6] * 3}
            for name, s in steps.items()}
    return {"key": f"timing/{framework}/{workers}/{rate!r}", "framework": framework, "workers": workers, "rate": rate,
            "ways": ways, "tiny_collective_s": 0.0014, "routes": {}, "load_average": [0.5, 0.5]}


def test_the_target_is_the_dense_runs_median_final_accuracy_less_the_margin():
    runs = [dense(0, 0.60), dense(1, 0.64), dense(2, 0.62),
            {**dense(3, 0.99), "stopped_by": "time cap"}]  # a run cut short is not a final accuracy
    goal = targets(runs, margin_points=1.0)
    assert goal[8]["dense_final"] == pytest.approx(0.62) and goal[8]["dense_runs"] == 3
    assert goal[8]["target"] == pytest.approx(0.61)


def test_time_and_steps_to_target_are_those_of_the_first_evaluation_at_or_above_it():
    record = run("Top-k + EF two-phase", 0, [(0, 0, 0.1), (5, 1.5, 0.4), (10, 3.0, 0.61), (15, 4.5, 0.7)])
    assert reached(record, 0.61) == (10, 3.0)
    assert reached(record, 0.71) is None


def test_a_median_over_seeds_is_a_time_only_if_more_than_half_reached_the_target():
    assert median_or_none([3.0, None, 1.0]) == 3.0
    assert median_or_none([3.0, None, None]) is None
    assert median_or_none([1.0, 2.0]) == 1.5 and median_or_none([1.0, None]) is None
    assert median_or_none([]) is None


def _results():
    """Three seeds at 8 workers and 100 Mbit/s: dense reaches 0.61 at step 20 (20 s), Top-k two-phase
    at step 30 after 3 s, LEGACY at step 20 after 2 s (seed 2: never), the fp16 hook at step 20
    after 10 s; a step timing there and at 1 Gbit/s (projected)."""
    runs = []
    for seed in range(3):
        runs.append(dense(seed, 0.62))
        runs.append(run("Top-k + EF two-phase", seed, [(0, 0, 0.1), (20, 2.0, 0.5), (30, 3.0 + seed, 0.61),
                                                       (40, 4.0 + seed, 0.62)]))
        legacy = 0.7 if seed < 2 else 0.5
        runs.append(run("LEGACY layer + EF two-phase", seed, [(0, 0, 0.1), (20, 2.0, legacy), (40, 4.0, legacy)]))
        runs.append(run("torch fp16_compress_hook", seed, [(0, 0, 0.1), (20, 10.0, 0.62), (40, 20.0, 0.62)]))
    fast = {"compute only": 0.05, "dense fp32": 0.1, "Top-k + EF two-phase": 0.06, "LEGACY layer + EF two-phase": 0.07}
    return {"setup": {"widths": list(QUICK_WIDTHS)}, "runs": runs, "parts": [],
            "timings": [timing("horovod", 8, RATE, {"compute only": 0.1, "dense fp32": 1.0,
                                                    "Top-k + EF two-phase": 0.11, "LEGACY layer + EF two-phase": 0.1}),
                        timing("horovod", 8, 1e9, fast)]}


def test_cells_speedups_and_the_issues_verdicts_follow_the_runs():
    results = _results()
    goal = targets(results["runs"], 1.0)
    table = cells(results, goal)
    by = {(c.arm, c.rate): c for c in table}
    topk = by[("Top-k + EF two-phase", RATE)]
    assert topk.source == "real" and topk.median_s == 4.0 and topk.range_s == (3.0, 5.0)
    assert topk.median_steps == 30 and topk.run_step_s == pytest.approx(5.0 / 40)
    legacy = by[("LEGACY layer + EF two-phase", RATE)]
    assert legacy.times == {0: 2.0, 1: 2.0, 2: None} and legacy.median_s == 2.0 and legacy.range_s == (2.0, None)
    ups = speedups(table)
    assert ups[(8, RATE, "Top-k + EF two-phase")]["vs_dense"] == pytest.approx(20 / 4)
    assert ups[(8, RATE, "LEGACY layer + EF two-phase")]["vs_best_baseline"] == pytest.approx(10 / 2)
    assert ups[(8, RATE, "LEGACY layer + EF two-phase")]["best_baseline"] == "torch fp16_compress_hook"
    verdict = claims(table, ups)
    assert verdict["best_ours"] == "LEGACY layer + EF two-phase" and verdict["vs_dense"] == pytest.approx(10)
    assert verdict["vs_dense_met"] and verdict["vs_best_baseline_met"]
    pair = verdict["legacy_vs_uniform"]  # seeds 0 and 1: 2 - 3 and 2 - 4; seed 2 reached by Top-k only
    assert pair["seeds"] == 2 and pair["mean_s"] == pytest.approx(-1.5)
    assert pair["only_reached"] == {"arm": [], "reference": [2]} and not pair["no_later"]


def test_a_baseline_at_a_matched_setting_is_held_apart_and_the_bound_bytes_set_comes_from_its_link():
    results = _results()
    for seed in range(3):  # PyTorch's PowerSGD at our rank: at the target after 1 s (20 steps of 0.05 s)
        curve = [(0, 0, 0.1), (20, 1.0, 0.62), (40, 2.0, 0.62)]
        results["runs"].append({**run("torch powerSGD_hook rank 4", seed, curve), "link_bytes_per_step": 1e5})
    table = cells(results, targets(results["runs"], 1.0))
    ups = speedups(table)
    legacy = ups[(8, RATE, "LEGACY layer + EF two-phase")]
    assert legacy["best_baseline"] == "torch powerSGD_hook rank 4" and legacy["vs_best_baseline"] == pytest.approx(0.5)
    assert legacy["best_default_baseline"] == "torch fp16_compress_hook"
    assert legacy["vs_best_default_baseline"] == pytest.approx(5)
    verdict = claims(table, ups)
    assert verdict["vs_best_baseline_met"] is False and verdict["vs_best_default_baseline_met"] is True
    # 1e5 bytes a step at 100 Mbit/s is 8 ms of its 50 ms step: 16%, so at most 1 / 0.84 sooner
    assert verdict["best_baseline_link_share"] == pytest.approx(0.16)
    assert verdict["bytes_alone_bound"] == pytest.approx(1 / 0.84)
    text = "\n".join(_claim_lines(verdict, None, {}))
    assert "at their defaults only" in text and "5.00x sooner than torch fp16_compress_hook (**meets**" in text
    assert "16% of its step" in text and "at most 1.19x sooner" in text


def test_where_compression_stops_paying_names_a_baseline_that_never_left_its_dense_warm_up():
    fast = 1e9
    runs = []
    for seed in range(3):
        runs.append(dense(seed, 0.62, rate=fast))
        runs.append(run("Top-k + EF two-phase", seed, [(0, 0, 0.1), (20, 4.0, 0.62), (40, 8.0, 0.62)], rate=fast))
        runs.append(run("torch powerSGD_hook defaults", seed, [(0, 0, 0.1), (20, 2.0, 0.62), (40, 4.0, 0.62)],
                        rate=fast))  # 40 steps, all inside its 1000-step plain-allreduce warm-up
    table = cells({"runs": runs, "timings": []}, targets(runs, 1.0))
    paying = stops_paying(table, speedups(table), rate=fast)
    assert paying[8]["not_faster_than_dense"] == [] and paying[8]["not_faster_than_best_baseline"] == [
        "Top-k + EF two-phase"]
    assert paying[8]["best_baseline"] == "torch powerSGD_hook defaults" and paying[8]["best_baseline_dense_throughout"]
    text = "\n".join(_claim_lines({"best_ours": None, "legacy_vs_uniform": {}}, None, paying))
    assert "no sooner than the best baseline (torch powerSGD_hook defaults, which ran a plain allreduce" in text
    ran_on = {**runs[2], "steps": 1200, "budget_steps": 1200, "seed": 9,
              "key": run_key("ddp", 8, fast, "torch powerSGD_hook defaults", 9)}  # one run past its warm-up
    table = cells({"runs": [*runs, ran_on], "timings": []}, targets(runs, 1.0))
    assert not stops_paying(table, speedups(table), rate=fast)[8]["best_baseline_dense_throughout"]


def test_projections_are_real_steps_to_target_times_the_timed_step_and_are_checked_against_real_runs():
    results = _results()
    table = cells(results, targets(results["runs"], 1.0))
    by = {(c.arm, c.rate): c for c in table}
    projected = by[("Top-k + EF two-phase", 1e9)]  # no real runs at 1 Gbit/s: 30 steps x 0.06 s
    assert projected.source == "projected" and projected.median_s == pytest.approx(1.8)
    assert by[("dense fp32", 1e9)].median_s == pytest.approx(20 * 0.1)
    checks = {c["arm"]: c for c in validation(table)}
    assert checks["dense fp32"]["projected_s"] == pytest.approx(20 * 1.0) and checks["dense fp32"]["within"]
    assert checks["Top-k + EF two-phase"]["ratio"] == pytest.approx(30 * 0.11 / 4.0)  # 0.825: outside 15%
    assert not checks["Top-k + EF two-phase"]["within"]


def test_projections_are_also_checked_from_each_launchs_first_step_timing_where_it_was_timed_again():
    results = _results()
    old = results["timings"][0]
    again = timing("horovod", 8, RATE, {"compute only": 0.1, "dense fp32": 1.0, "Top-k + EF two-phase": 0.05,
                                        "LEGACY layer + EF two-phase": 0.1})  # Top-k's step made cheaper since
    results["timings"][0] = again
    results["superseded"] = [{**old, "kind": "timings", "superseded_by": "b"},
                             {**timing("horovod", 8, RATE, {"dense fp32": 9.0}), "kind": "timings"},  # a later one
                             {**results["runs"][0], "kind": "runs"}]
    assert first_timings(results) == [{**old, "kind": "timings", "superseded_by": "b"}, results["timings"][1]]
    goal = targets(results["runs"], 1.0)
    now = {c["arm"]: c for c in validation(cells(results, goal)) if c["rate"] == RATE}
    first = {c["arm"]: c for c in validation(cells({**results, "timings": first_timings(results)}, goal))
             if c["rate"] == RATE}
    assert now["Top-k + EF two-phase"]["projected_s"] == pytest.approx(30 * 0.05)
    assert first["Top-k + EF two-phase"]["projected_s"] == pytest.approx(30 * 0.11)
    text = "\n".join(_validation_lines(list(now.values()), list(first.values())))
    assert f"{sum(c['within'] for c in first.values())} of {len(first)} projections are within 15%" in text
    assert first_timings(_results()) == _results()["timings"]  # nothing timed again: the timings it has


def test_the_communication_share_and_the_planner_check_come_from_the_step_timing():
    timed = _results()["timings"][0]
    share = compute_share(timed)
    assert share["share"] == pytest.approx(0.9) and share["paired_share"] == pytest.approx(0.9)
    check = planner_check(timed, list(QUICK_WIDTHS))
    assert check["latency_s"] == pytest.approx(0.0014 / 14)  # 2 (P - 1) ring steps at P = 8
    assert check["rows"]["dense fp32"]["estimate_s"] > check["rows"]["Top-k + EF two-phase"]["estimate_s"]
    assert check["pick"] in ("Top-k + EF two-phase", "LEGACY layer + EF two-phase")
    assert check["fastest"] == "LEGACY layer + EF two-phase" and check["met"] == (check["pick_vs_fastest"] <= 1.1)
    dense = check["rows"]["dense fp32"]
    row = next(line for line in _planner_lines([check]) if line.startswith("| dense fp32 |"))
    assert row.endswith(f"| {dense['estimate_s']:.3f} | 1.000 | {1.0 - dense['estimate_s']:+.3f} |")


def test_the_floor_reading_takes_each_arms_step_where_the_link_is_no_limit_and_is_no_launch_of_its_own():
    """The default plan times every launch's steps at FLOOR_RATE too; there each arm's step is a floor
    of its estimate (the larger of the two is judged again), and no time to target is made."""
    args = driver.parse([])
    floors = [launch for launch in driver.launches(args) if launch.rate == FLOOR_RATE]
    assert {(launch.framework, launch.workers, launch.seeds) for launch in floors} == {
        ("horovod", 8, ()), ("ddp", 8, ()), ("horovod", 16, ()), ("ddp", 16, ())}
    steps = {"compute only": 0.01, "DDP allreduce fp32": 0.09, "BF16": 0.075, "PowerSGD rank 4": 0.085}
    timed = timing("ddp", 8, 1e9, steps)
    fast = timing("ddp", 8, FLOOR_RATE, {**steps, "DDP allreduce fp32": 0.07, "BF16": 0.072, "PowerSGD rank 4": 0.084})
    results = {**_results(), "timings": [timed, fast]}
    results["runs"] += [run(arm, 0, [(0, 0, 0.1), (30, 3.0, 0.9)], rate=1e9) for arm in ("BF16", "PowerSGD rank 4")]
    assert {c.rate for c in cells(results, targets(results["runs"], 1.0))} == {RATE, 1e9}  # none at FLOOR_RATE
    checks = planner_checks(results["timings"], list(WIDTHS))
    assert len(checks) == 1 and checks[0] == planner_check(timed, list(WIDTHS), fast)
    check = checks[0]
    assert check["pick"] == "PowerSGD rank 4" and not check["met"]  # the fewest bytes, 1.13x BF16
    for name, row in check["rows"].items():
        assert row["floor_s"] == fast["ways"][name]["step_s"][0]
        assert row["bounded_s"] == max(row["estimate_s"], row["floor_s"])
    assert check["rows"]["PowerSGD rank 4"]["bounded_s"] == 0.084  # its floor, above its estimate
    floor = check["bounded"]
    assert floor["pick"] == "BF16" and floor["fastest"] == "BF16" and floor["met"]
    text = "\n".join(_planner_lines(checks))
    assert text.startswith("The planner's pick within 10% of the fastest arm: **0 of 1** launches; with each "
                           "arm's step on a 10 Gbit/s link as its floor, **1 of 1**.")
    assert "With the floor, the pick **BF16** measures 1.00x the fastest: **meets** the target" in text
    bf16 = check["rows"]["BF16"]["estimate_s"]
    assert f"| BF16 | `BF16()` | default | {bf16:.3f} | 0.075 | {0.075 - bf16:+.3f} | 0.072 | 0.072 |" in text
    # Without a floor timing of every arm, the second reading is left out, not made up.
    partial = planner_check(timed, list(WIDTHS), timing("ddp", 8, FLOOR_RATE, {"BF16": 0.07}))
    assert "bounded" not in partial and "floor_s" not in partial["rows"]["BF16"]
    assert "floor" not in "\n".join(_planner_lines([partial]))


def test_the_report_says_when_a_target_was_never_reached_and_invents_no_time(tmp_path):
    results = _results()
    results["setup"].update(global_batch=256, lr=0.05, momentum=0.9, epochs=4, eval_epochs=1)
    results["runs"] = [r for r in results["runs"] if r["arm"] != "torch fp16_compress_hook"]
    for r in results["runs"]:  # nothing but dense reaches dense's final accuracy
        if r["arm"] != "dense fp32":
            r["curve"] = [[s, t, min(a, 0.55)] for s, t, a in r["curve"]]
    path = tmp_path / "time_to_accuracy.json"
    path.write_text(json.dumps(results))
    summary = write_report(path, tmp_path, margin=1.0, plan={"left": 2, "seeds": 3})
    text = (tmp_path / "time_to_accuracy.md").read_text()
    assert "| LEGACY layer + EF two-phase | real | 0/3 | **not reached** | - | - |" in text
    assert "seed 2 not reached: stopped by its budget after 40 steps, 4.0 s" in text
    assert "none of our arms has a time to target yet" in text and "**partial**: 2 launch parts" in text
    assert summary["claims"]["vs_dense"] is None and summary["claims"]["vs_dense_met"] is None
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 1000
    assert json.loads(path.read_text())["summary"]["targets"]["8"]["target"] == pytest.approx(0.61)


def test_the_load_of_the_workers_themselves_is_not_taken_for_other_work(monkeypatch):
    from benchmarks.common import time_to_accuracy_report as report

    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    results = _results()
    for record in results["runs"]:
        record["load_average"] = [9.0, 9.5]  # 8 workers on 2 cores
    results["parts"] = [{"load_before": 0.4}, {"load_before": 1.9}]
    text = report._loaded(results)
    assert text == "The 8 workers share this machine's 2 cores (load average up to 9.5 during runs, the workers' " \
                   "own threads counted)."
    results["parts"].append({"load_before": 3.5})
    assert "**Other work ran**: the load average was up to 3.5 when a part began" in report._loaded(results)


def test_launches_go_seed_by_seed_and_a_rerun_skips_what_is_done(tmp_path):
    args = driver.parse(["--seeds", "2", "--workers", "8", "16", "--rates", "1e8", "--real", "8@1e8"])
    plan = driver.launches(args)
    assert [(launch.framework, launch.workers, launch.seeds) for launch in plan] == [
        ("horovod", 8, (0,)), ("ddp", 8, (0,)), ("horovod", 8, (1,)), ("ddp", 8, (1,)),
        ("horovod", 16, ()), ("ddp", 16, ())]
    assert "FP16" in plan[0].arms and "FP16" not in plan[4].arms  # above 8 workers, the main arms only
    path = tmp_path / "time_to_accuracy.json"
    append_result(path, "timings", timing("horovod", 8, RATE, {"dense fp32": 1.0}))
    append_result(path, "runs", run("dense fp32", 0, [(0, 0, 0.1), (10, 1.0, 0.5)]))
    untimed, runs = driver.pending(plan[0], load_results(path))
    assert untimed, "a timing of fewer arms than the launch has is made again"
    assert ("dense fp32", 0) not in runs and len(runs) == len(plan[0].arms) - 1
    append_result(path, "timings", timing("horovod", 8, RATE, {name: 1.0 for name in plan[0].arms}))
    assert not driver.pending(plan[0], load_results(path))[0] and len(load_results(path)["timings"]) == 1
    assert driver.pending(plan[2], load_results(path)) == (False, [(arm, 1) for arm in plan[2].arms])


def test_a_redo_sets_aside_only_the_selected_records_of_other_code_and_the_same_command_goes_on(tmp_path):
    """``--redo-other-code``: the selected launches' runs and step timing made with other code (or
    none recorded) move to ``superseded`` and are pending again; another framework's, another
    rate's, and those already made with the code of now stay where they are."""
    args = driver.parse(["--seeds", "1", "--workers", "8", "--rates", "1e8", "--real", "8@1e8",
                         "--arms", "dense fp32", "torch fp16_compress_hook", "--redo-other-code"])
    path = tmp_path / "time_to_accuracy.json"
    append_result(path, "timings", timing("horovod", 8, RATE, {"dense fp32": 1.0}))  # no code recorded
    append_result(path, "runs", {**run("dense fp32", 0, [(0, 0, 0.1), (10, 1.0, 0.5)]), "code": "old"})
    append_result(path, "runs", {**run("torch fp16_compress_hook", 0, [(0, 0, 0.1), (10, 1.0, 0.5)]),
                                 "code": "new"})
    append_result(path, "runs", run("dense fp32", 0, [(0, 0, 0.1), (10, 1.0, 0.5)], rate=1e9))  # not selected
    assert driver.supersede_other_code(args, path, "new") == 2
    results = load_results(path)
    assert [r["arm"] for r in results["runs"]] == ["torch fp16_compress_hook", "dense fp32"]
    assert results["runs"][1]["rate"] == 1e9 and results["timings"] == []
    assert sorted((r["kind"], r["superseded_by"]) for r in results["superseded"]) == [("runs", "new"),
                                                                                      ("timings", "new")]
    plan = driver.launches(args)
    assert driver.pending(plan[0], results) == (True, [("dense fp32", 0)])
    assert driver.supersede_other_code(args, path, "new") == 0  # run again: nothing more is set aside


def test_a_redo_of_some_of_a_launchs_arms_keeps_the_step_timing_of_the_others(tmp_path):
    args = driver.parse(["--seeds", "1", "--workers", "8", "--rates", "1e8", "--real", "8@1e8",
                         "--arms", "dense fp32", "--redo-other-code"])
    path = tmp_path / "time_to_accuracy.json"
    both = timing("horovod", 8, RATE, {"compute only": 0.1, "dense fp32": 1.0, "FP16": 0.5})
    append_result(path, "timings", both)
    append_result(path, "runs", run("dense fp32", 0, [(0, 0, 0.1), (10, 1.0, 0.5)]))
    assert driver.supersede_other_code(args, path, "new") == 1
    results = load_results(path)
    assert results["runs"] == [] and results["timings"] == [both]
    assert driver.pending(driver.launches(args)[0], results) == (False, [("dense fp32", 0)])
    every = driver.parse(["--seeds", "1", "--workers", "8", "--rates", "1e8", "--real", "8@1e8",
                          "--arms", "dense fp32", "FP16", "--retime-other-code"])
    append_result(path, "runs", run("FP16", 0, [(0, 0, 0.1), (10, 1.0, 0.5)]))
    assert driver.supersede_other_code(every, path, "new", ("timings",)) == 1  # every arm it timed: timed again
    results = load_results(path)
    assert results["timings"] == [] and [r["arm"] for r in results["runs"]] == ["FP16"]  # the runs stay
    assert driver.pending(driver.launches(every)[0], results) == (True, [("dense fp32", 0)])


def test_other_code_is_a_commit_whose_measuring_code_differs(tmp_path):
    import subprocess

    def commit(path, text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path], cwd=tmp_path,
                       check=True)
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    first = commit("grace_legacy/a.py", "x = 1\n")
    report = commit("benchmarks/common/time_to_accuracy_report.py", "# the report\n")
    results = commit("benchmarks/results/time_to_accuracy.json", "{}\n")
    worker = commit("benchmarks/common/time_to_accuracy_worker.py", "# the workers\n")
    library = commit("grace_legacy/a.py", "x = 2\n")
    assert driver.same_code(first, results, tmp_path) and driver.same_code(report, first, tmp_path)
    assert not driver.same_code(first, worker, tmp_path) and not driver.same_code(worker, library, tmp_path)
    assert driver.same_code(library, library, tmp_path)
    assert not driver.same_code(None, library, tmp_path) and not driver.same_code(f"{library}-dirty", library, tmp_path)
    assert not driver.same_code("0000000", library, tmp_path)  # a commit this clone does not have


def test_a_results_file_of_another_set_up_is_refused(tmp_path):
    path = tmp_path / "time_to_accuracy.json"
    driver.start_results(path, driver.parse(["--quick"]))
    driver.start_results(path, driver.parse(["--quick", "--seeds", "3", "--margin", "2"]))  # same set-up
    with pytest.raises(SystemExit, match="another set-up.*epochs: 2.0, now 5.0"):
        driver.start_results(path, driver.parse(["--quick", "--epochs", "5"]))


def test_the_equal_bytes_density_gives_the_two_phase_route_the_gathered_routes_link_bytes():
    from grace_legacy import TopK
    from grace_legacy.planner import plan

    shapes = shapes_of(wide_mlp())
    density = equal_bytes_density(shapes, 8)
    gathered = plan(TopK(0.01), shapes, world_size=8).phase_totals(0)[0]
    two_phase = plan(TopK(density), shapes, world_size=8, route="auto").phase_totals(0)[0]
    assert two_phase == pytest.approx(gathered, rel=1e-3) and 0.03 < density < 0.05  # about P / 2 x at P = 8
    assert "scattergather" in plan(TopK(density), shapes, world_size=8, route="auto").routes()


def test_arms_the_planner_cannot_tell_apart_are_all_its_pick_and_the_slowest_is_held_to_the_fastest():
    # two dense allreduces (PyTorch's PowerSGD hook in its warm-up is one), none of them ours
    timed = timing("ddp", 8, RATE, {"compute only": 0.1, "DDP allreduce fp32": 1.0,
                                    "torch powerSGD_hook defaults": 1.25})
    check = planner_check(timed, list(WIDTHS))
    assert check["tied"] == ["DDP allreduce fp32", "torch powerSGD_hook defaults"]
    assert check["pick"] == "torch powerSGD_hook defaults" and check["fastest"] == "DDP allreduce fp32"
    assert check["pick_vs_fastest"] == pytest.approx(1.25) and not check["met"]
    assert "(the slowest of its estimate's ties, with DDP allreduce fp32)" in "\n".join(_planner_lines([check]))


def test_where_ours_ties_with_a_baseline_the_planners_pick_is_ours_whichever_is_slower():
    """The planner configures our bundles: PyTorch's PowerSGD hook at our rank is the same plan in
    PyTorch's code, shown beside the pick but not held for it, faster or slower."""
    for ours, theirs in ((0.2, 0.25), (0.25, 0.2)):
        timed = timing("ddp", 8, RATE, {"compute only": 0.1, "DDP allreduce fp32": 1.0, "PowerSGD rank 4": ours,
                                        "torch powerSGD_hook rank 4": theirs})
        check = planner_check(timed, list(WIDTHS))
        assert check["tied"] == ["PowerSGD rank 4", "torch powerSGD_hook rank 4"]
        assert check["pick"] == "PowerSGD rank 4"
        assert check["pick_vs_fastest"] == pytest.approx(ours / min(ours, theirs))
        assert check["met"] == (ours < theirs)
        text = "\n".join(_planner_lines([check]))
        assert (f"(tied in its estimate with torch powerSGD_hook rank 4, which it does not configure: the same plan "
                f"in another library's code, measured {theirs:.3f} s)") in text
