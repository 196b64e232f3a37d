"""The time-to-accuracy benchmark's report (:mod:`benchmarks.accuracy.time_to_accuracy`):
``time_to_accuracy.md`` and ``.png`` from the results file, and the summary written back into it.
The statistics are :mod:`benchmarks.common.time_to_accuracy_analysis`'s; here they are put in
words and tables, each figure with where it came from (real runs or a projection from step timing)
and the load the machine was under."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.common.limited_link import label
from benchmarks.common.time_to_accuracy_analysis import (
    CLAIM_RATE,
    CLAIM_WORKERS,
    FINAL_EVALS,
    FLOOR_RATE,
    LEGACY,
    PLANNER_TOLERANCE,
    PROJECTION_TOLERANCE,
    UNIFORM,
    VS_BASELINE,
    VS_DENSE,
    Cell,
    cells,
    claims,
    compute_share,
    first_timings,
    median_step,
    planner_checks,
    speedups,
    stops_paying,
    targets,
    timing_of,
    validation,
)
from benchmarks.common.time_to_accuracy_arms import ARM_LIST, ARMS, HOROVOD, OURS, wide_mlp

#: The share of a dense fp32 step at 8 workers and 100 Mbit/s that must be communication.
COMMUNICATION_SHARE = 0.70


def _s(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("**meets**" if met else "**misses**")


def _later(no_later: bool | None) -> str:
    return "undecided (fewer than 2 seeds)" if no_later is None else ("**no later**" if no_later else "**later**")


def _row(cell: Cell, up: dict[str, Any]) -> str:
    low, high = cell.range_s
    spread = "-" if low is None else f"{low:.1f}-{'never' if high is None else f'{high:.1f}'}"
    steps = "-" if cell.median_steps is None else f"{cell.median_steps:.0f}"
    run_step = "-" if cell.run_step_s is None else f"{cell.run_step_s:.3f}"
    timed = "-" if cell.timed_step_s is None else f"{cell.timed_step_s:.3f}"
    link = "-" if cell.link_bytes is None else f"{cell.link_bytes / 1e6:.3f}"
    volume = "-" if cell.volume is None else f"{cell.volume:.4f}"
    notes = []
    never = [seed for seed, t in cell.times.items() if t is None]
    if never and cell.source == "real":
        notes.append("; ".join(f"seed {seed} not reached: stopped by its {cell.stopped[seed]} after "
                               f"{cell.budget_steps[seed]} steps, {cell.budget_s[seed]:.1f} s" for seed in never))
    elif never:
        notes.append(f"seeds {never} not reached in their runs")
    return (f"| {cell.arm} | {cell.source} | {cell.reached_seeds}/{len(cell.times)} | **{_s(cell.median_s)}** | "
            f"{spread} | {steps} | {run_step} | {timed} | {link} | {volume} | {_x(up['vs_dense'])} | "
            f"{_x(up['vs_best_baseline'])} | {' '.join(notes)} |")


TABLE_HEAD = ("| arm | source | reached | time to target s (median) | range s | steps to target | step s (runs) "
              "| step s (timed) | link MB/step | volume | vs dense fp32 | vs best baseline | notes |\n"
              + "|---" * 13 + "|")


def _parts(results: dict[str, Any]) -> list[str]:
    lines = ["| part started | code | command | minutes | load before | load after | launches |", "|---" * 7 + "|"]
    for part in results["parts"]:
        launched = "; ".join(f"{p['launch']}{' (timed)' if p['timed'] else ''}: {p['runs']} runs"
                             for p in part["launches"]) or "-"
        if part.get("superseded"):
            launched = f"set aside {part['superseded']} records made with other code; {launched}"
        # Parts made before the code was recorded: not known.
        lines.append(f"| {part['started']} | {part.get('code', '-')} | `{part['command']}` | "
                     f"{part['duration_s'] / 60:.1f} | "
                     f"{part['load_before']:.1f} | {part['load_after']:.1f} | {launched} |")
    return lines


def _loaded(results: dict[str, Any]) -> str:
    """What the load average says. During runs it counts the workers' own threads (more workers than
    cores here), so only the load when a part began, before its workers started, tells of other work."""
    cores = os.cpu_count() or 1
    records = results["runs"] + results["timings"]
    during = [x for record in records for x in record.get("load_average", [])]
    before = [part["load_before"] for part in results["parts"]]
    workers = sorted({record["workers"] for record in records})
    out = []
    if during and workers and max(workers) > cores:
        out.append(f"The {' and '.join(map(str, workers))} workers share this machine's {cores} cores (load average "
                   f"up to {max(during):.1f} during runs, the workers' own threads counted).")
    if before and max(before) > cores:
        out.append(f"**Other work ran**: the load average was up to {max(before):.1f} when a part began, before its "
                   "workers started (a 1-minute average, which also holds the tail of a part just ended; the parts "
                   "table has each): those parts' times are not those of a quiet machine.")
    return " ".join(out)


def _claim_lines(claim: dict[str, Any], share: dict[str, float] | None, paying: dict[int, dict[str, Any]]
                 ) -> list[str]:
    where = f"{CLAIM_WORKERS} workers, {label(CLAIM_RATE)}"
    lines = []
    if share is not None:
        lines.append(f"- Communication share of a dense fp32 step at {where} (Horovod): "
                     f"1 - compute-only {share['compute_s']:.3f} s / dense {share['dense_s']:.3f} s = "
                     f"**{share['share']:.0%}** (paired by iteration {share['paired_share']:.0%}): "
                     f"{_verdict(share['share'] >= COMMUNICATION_SHARE)} the {COMMUNICATION_SHARE:.0%} the "
                     "set-up needs.")
    if claim["best_ours"] is None:
        lines.append(f"- At {where} none of our arms has a time to target yet: the targets are not measured.")
    else:
        lines.append(f"- At {where} our fastest arm to the target is **{claim['best_ours']}** ({claim['source']}): "
                     f"{_x(claim['vs_dense'])} sooner than dense fp32 ({claim['dense_reference']}, the sooner of "
                     f"Horovod's and DDP's; {_verdict(claim['vs_dense_met'])} the "
                     f"{VS_DENSE:g}x target) and {_x(claim['vs_best_baseline'])} sooner than the best baseline, "
                     f"{claim['best_baseline'] or 'none reached the target'} "
                     f"({_verdict(claim['vs_best_baseline_met'])} the {VS_BASELINE:g}x target).")
        if claim.get("best_default_baseline") != claim["best_baseline"]:
            lines.append(f"  - Against the baselines at their defaults only (the matched settings left out): "
                         f"{_x(claim.get('vs_best_default_baseline'))} sooner than "
                         f"{claim.get('best_default_baseline') or 'none reached the target'} "
                         f"({_verdict(claim.get('vs_best_default_baseline_met'))} the {VS_BASELINE:g}x target).")
        if claim.get("bytes_alone_bound") is not None:
            lines.append(f"  - What bytes alone can buy: {claim['best_baseline']}'s busiest link carries its step's "
                         f"bytes for {claim['best_baseline_link_share']:.0%} of its step (bytes x 8 / rate over the "
                         f"step), so at its steps to target an arm that sent nothing would be at most "
                         f"{_x(claim['bytes_alone_bound'])} sooner; the rest of the step is computation and "
                         "waiting on the other workers, which fewer bytes do not shorten.")
    pair = claim["legacy_vs_uniform"]
    if pair.get("available"):
        only = pair["only_reached"]
        lines.append(f"- {LEGACY} - {UNIFORM} in time to target at equal link bytes, paired by seed: "
                     f"{pair['mean_s']:+.1f} s, 95% interval [{pair['low_s']:+.1f}, {pair['high_s']:+.1f}] over "
                     f"{pair['seeds']} seeds both reached"
                     + (f"; seeds only LEGACY reached: {only['arm']}" if only["arm"] else "")
                     + (f"; seeds only uniform Top-k reached: {only['reference']}" if only["reference"] else "")
                     + f": {_later(pair['no_later'])} (the target: no later).")
    for workers, lists in paying.items():
        dense_no = ", ".join(lists["not_faster_than_dense"]) or "none"
        base_no = ", ".join(lists["not_faster_than_best_baseline"]) or "none"
        dense_all_along = (f" ({lists['best_baseline']}, which ran a plain allreduce every step of its runs: "
                           "DDP's dense fp32 allreduce under another name)"
                           if lists.get("best_baseline_dense_throughout") else "")
        lines.append(f"- At {workers} workers and 1 Gbit/s, our arms no sooner than dense fp32 (or never): {dense_no}; "
                     f"no sooner than the best baseline{dense_all_along}: {base_no}.")
    return lines


def _validation_lines(checks: list[dict[str, Any]], first: list[dict[str, Any]] | None = None) -> list[str]:
    """The projections against the real runs; ``first``: the same from each launch's first step
    timing, where some were timed again later (with other code, or on a quieter machine)."""
    if not checks:
        return ["No launch has both real runs and step timing yet."]
    lines = [f"| arm | workers | rate | real s | projected s | projected / real | within {PROJECTION_TOLERANCE:.0%} |",
             "|---" * 7 + "|"]
    for c in checks:
        lines.append(f"| {c['arm']} | {c['workers']} | {label(c['rate'])} | {c['real_s']:.1f} | "
                     f"{c['projected_s']:.1f} | {c['ratio']:.2f} | {'yes' if c['within'] else '**no**'} |")
    held = sum(c["within"] for c in checks)
    lines.append(f"\n{held} of {len(checks)} projections within {PROJECTION_TOLERANCE:.0%} of the real runs.")
    if first:
        kept = sum(c["within"] for c in first)
        lines.append(f"Some launches were timed again after their runs (the parts table says with which code); "
                     f"from each launch's first step timing, made beside its first runs and kept under "
                     f"`superseded`, {kept} of {len(first)} projections are within {PROJECTION_TOLERANCE:.0%}. "
                     "Where the timing is newer than the runs, a ratio below 1 can come from a step made "
                     "cheaper since or from runs made on a busier machine; this check does not tell which.")
    return lines


def _ties(check: dict[str, Any]) -> str:
    others = [name for name in check["tied"] if name != check["pick"]]
    if not others:
        return ""
    rows = check["rows"]
    theirs = [n for n in others if ARMS[n].role != OURS and ARMS[check["pick"]].role == OURS]
    ours = [n for n in others if n not in theirs]
    said = [f"the slowest of its estimate's ties, with {', '.join(ours)}"] if ours else []
    said += [f"tied in its estimate with {n}, which it does not configure: the same plan in another library's "
             f"code, measured {rows[n]['measured_s']:.3f} s" for n in theirs]
    return f" ({'; '.join(said)})"


def _rho(value: float) -> str:
    return "n/a (fewer than 3 arms)" if value != value else f"{value:.2f}"


def _planner_lines(checks: list[dict[str, Any]]) -> list[str]:
    if not checks:
        return ["No step timing yet."]
    bounded = [c["bounded"] for c in checks if "bounded" in c]
    met, floored = sum(c["met"] for c in checks), sum(b["met"] for b in bounded)
    lines = [f"The planner's pick within {PLANNER_TOLERANCE:.0%} of the fastest arm: **{met} of {len(checks)}** "
             "launches" + (f"; with each arm's step on a {label(FLOOR_RATE)} link as its floor, **{floored} of "
                           f"{len(bounded)}**" if bounded else "") + ".", ""]
    for check in checks:
        lines += [f"**{check['framework']}, {check['workers']} workers, {label(check['rate'])}**: compute "
                  f"{check['compute_s']:.3f} s, latency {check['latency_s'] * 1e6:.0f} us per collective step "
                  f"(the measured 8-byte allreduce over its {2 * (check['workers'] - 1)} ring steps). The "
                  f"planner's pick **{check['pick']}**{_ties(check)} measures {check['pick_vs_fastest']:.2f}x the "
                  f"fastest ({check['fastest']}): {_verdict(check['met'])} the {PLANNER_TOLERANCE:.0%} target; "
                  f"rank correlation of estimate and measurement {_rho(check['spearman'])}."]
        floor = check.get("bounded")
        if floor:
            lines[-1] += (f" With the floor, the pick **{floor['pick']}**{_ties({**floor, 'rows': check['rows']})} "
                          f"measures {floor['pick_vs_fastest']:.2f}x the fastest: {_verdict(floor['met'])} the "
                          f"target; rank correlation {_rho(floor['spearman'])}.")
        extra = ("", "") if floor is None else (" floor s | larger s |", "|---" * 2)
        lines += ["", "| arm | planned as | route | estimated step s | measured step s | measured - estimated s |"
                  + extra[0], "|---" * 6 + extra[1] + "|"]
        for name, row in sorted(check["rows"].items(), key=lambda item: item[1]["estimate_s"]):
            lines.append(f"| {name} | `{row['compressor']}` | {row['route']} | {row['estimate_s']:.3f} | "
                         f"{row['measured_s']:.3f} | {row['measured_s'] - row['estimate_s']:+.3f} |"
                         + ("" if floor is None else f" {row['floor_s']:.3f} | {row['bounded_s']:.3f} |"))
        lines.append("")
    return lines


def _curves(results: dict[str, Any], arm: str, workers: int, rate: float) -> list[list[tuple[float, float]]]:
    """(clock s, accuracy %) per run of ``arm`` at ``workers`` and ``rate``: the real runs' clocks, or
    where there are none, the runs at that worker count (a seed's first) with each evaluation's steps
    times the launch's timed step there (the projection)."""
    runs = [r for r in results["runs"] if (r["arm"], r["workers"], r["rate"]) == (arm, workers, rate)]
    if runs:
        return [[(p[1], 100 * p[2]) for p in run["curve"]] for run in runs]
    step = median_step(timing_of(results["timings"], ARMS[arm].framework, workers, rate), arm)
    firsts: dict[int, dict[str, Any]] = {}
    for run in results["runs"]:
        if (run["arm"], run["workers"]) == (arm, workers):
            firsts.setdefault(run["seed"], run)
    return [] if step is None else [[(p[0] * step, 100 * p[2]) for p in run["curve"]] for run in firsts.values()]


def plot(results: dict[str, Any], goal: dict[int, dict[str, float]], panels: list[tuple[int, float, str]],
         path: Path) -> None:
    """Accuracy against the training clock, a panel per worker count and rate (``panels``: workers,
    rate, source): every seed's curve, a colour per arm (Horovod's solid, DDP's dashed), the target
    dotted in black."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(7 * max(1, len(panels)), 5.5), squeeze=False)
    colours = plt.get_cmap("tab10")
    for axis, (workers, rate, source) in zip(axes[0], panels, strict=False):
        for framework, style in ((HOROVOD, "-"), ("ddp", "--")):
            for index, arm in enumerate(a for a in ARM_LIST if a.framework == framework):
                for number, curve in enumerate(_curves(results, arm.name, workers, rate)):
                    axis.plot([x for x, _ in curve], [y for _, y in curve], style, color=colours(index % 10),
                              linewidth=1.2, alpha=0.85, label=arm.name if number == 0 else None)
        if workers in goal:
            axis.axhline(100 * goal[workers]["target"], color="black", linestyle=":", linewidth=1.2, label="target")
        axis.set_xlim(left=0)
        axis.set_xlabel("training clock (s, evaluations excluded)" + (
            "" if source == "real" else "; projected: steps x timed step"))
        axis.set_ylabel("held-out accuracy (%)")
        axis.set_title(f"{workers} workers, {label(rate)} links ({source})")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(path: Path, results_dir: Path, margin: float, plan: dict[str, Any]) -> dict[str, Any]:
    """``time_to_accuracy.md`` and ``.png`` in ``results_dir`` from the results file ``path``; the
    summary (also written into the results file) is returned."""
    results = json.loads(path.read_text())
    setup = results["setup"]
    goal = targets(results["runs"], margin)
    table = cells(results, goal)
    ups = speedups(table)
    claim = claims(table, ups)
    share = compute_share(timing_of(results["timings"], HOROVOD, CLAIM_WORKERS, CLAIM_RATE))
    paying = stops_paying(table, ups)
    checks = validation(table)
    first = first_timings(results)
    first_checks = validation(cells({**results, "timings": first}, goal)) if first != results["timings"] else None
    planners = planner_checks(results["timings"], setup["widths"])
    parameters = sum(p.numel() for p in wide_mlp(tuple(setup["widths"])).parameters())
    sections = []
    for workers, rate in sorted({(c.workers, c.rate) for c in table}):
        rows = [_row(c, ups[(c.workers, c.rate, c.arm)]) for c in table if (c.workers, c.rate) == (workers, rate)]
        sections += [f"### {workers} workers, {label(rate)}", "", TABLE_HEAD, *rows, ""]
    goal_lines = [f"- {w} workers: dense fp32 final accuracy {100 * g['dense_final']:.2f}% (median of "
                  f"{g['dense_runs']} runs, each the mean of its last {FINAL_EVALS} evaluations), target "
                  f"**{100 * g['target']:.2f}%**" for w, g in goal.items()] or ["- no dense fp32 run has finished yet"]
    status = ("complete" if plan["left"] == 0 else
              f"**partial**: {plan['left']} launch parts (step timings and runs) of the plan are still to be made; "
              f"rerun the command to go on")
    arms = "\n".join(f"- **{arm.name}** ({arm.framework}, {arm.role}{', main' if arm.main else ''}): `{arm.spelled}`"
                     for arm in ARM_LIST)
    text = "\n".join([
        "# Time to accuracy", "",
        "How much sooner does a user reach the dense run's accuracy? `python -m benchmarks.accuracy.time_to_accuracy` "
        f"(its docstring says how it runs). Status: {status}.", "",
        _loaded(results), "",
        *_parts(results), "",
        "## Set-up", "",
        f"mnist1d (`make_dataset()`, generated locally) with an MLP of widths {setup['widths']} "
        f"({parameters:,} parameters): little compute per step, many parameters, so that on slow links a dense "
        f"step is mostly communication. Global batch {setup['global_batch']} split over the workers (the same "
        f"arithmetic per step at any worker count), SGD at {setup['lr']} with momentum {setup['momentum']}, constant; "
        f"each run {setup['epochs']:g} epochs, evaluated every {setup['eval_epochs']:g} epochs; {plan['seeds']} seeds, "
        "paired (a seed fixes the initial weights and the batches for every arm). Workers are real processes, each "
        "in its own network namespace on links rate limited both ways with `tc tbf`; Horovod's under its Gloo "
        "launcher, DDP's as torchrun starts them. The clock counts training steps only (evaluations excluded). "
        "The workers share this machine's cores: each one's compute is slower than on a host of its own, and "
        "Horovod's own wait (dense fp32, `hvd.Compression.fp16`) spins, taking CPU time from the other workers, "
        "where grace_legacy's and PyTorch's wait asleep.", "",
        f"Target: the dense fp32 runs' final accuracy less {margin:g} points:", "", *goal_lines, "",
        "Arms (role: dense reference, a baseline a user could take instead, or ours; main: also at 16 workers):", "",
        arms, "",
        "PyTorch's `powerSGD_hook` at its defaults runs a plain allreduce for its first 1000 steps "
        "(`start_powerSGD_iter=1000`): what a user of the defaults sees in a run of this length.", "",
        "## The issue's targets", "", *_claim_lines(claim, share, paying), "",
        "## Time to target", "",
        "*source*: real (the clock of real runs at that rate) or projected (each real run's steps to target at the "
        "same worker count times the launch's median timed step). *range*: over seeds; never: a seed that did not "
        "reach the target within its budget. *step s (runs)*: clock / steps of the real runs; *(timed)*: the "
        "launch's step timing (bursts of consecutive steps, the arms interleaved burst by burst). *link MB/step*: "
        "the busiest link's bytes per step (interface "
        "counters, headers included). *volume*: the bundle's link bytes / a dense allreduce's. *vs dense fp32*: "
        "against the sooner of Horovod's and DDP's dense fp32 allreduce; *best baseline*: the soonest to target of "
        "Horovod's fp16 and PyTorch's fp16 and PowerSGD hooks at the same workers and rate, PowerSGD's at its "
        "defaults and at our rank (a setting matched to ours).",
        "", *sections,
        "## Projection against the real runs", "", *_validation_lines(checks, first_checks), "",
        "## The planner's ranking", "",
        "Each arm's step estimated by `grace_legacy.planner.step_time` from the measured compute-only step (what "
        "`python -m grace_legacy plan --model benchmarks.common.time_to_accuracy_arms:wide_mlp --workers P "
        "--bandwidth RATE --latency L --compute C` prints per route), against the measured step. The estimate "
        "leaves out the compressor's own arithmetic and the waits of workers that share this machine's cores for "
        "a peer to be scheduled: the *measured - estimated* column is what they and the model's errors add up "
        f"to, per arm. The second reading takes each arm's step timed on a {label(FLOOR_RATE)} link (*floor*: "
        "faster than these workers' cores can fill, so the cores and the arm's own work set it) as a floor: "
        "the estimate is the larger of the two (*larger*). The first reading adds all of an arm's link time to the "
        "compute; the second hides it behind the arm's own work where that is longer. Which is nearer differs "
        "by arm, and neither tells which: how much of an arm's link time the shared cores hide (while one "
        "worker waits on its link, others compute) is in neither.", "",
        *_planner_lines(planners),
        "![accuracy against the training clock](time_to_accuracy.png)", ""])
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "time_to_accuracy.md").write_text(text)
    panels = [(w, r, " + ".join(sorted({c.source for c in table if (c.workers, c.rate) == (w, r)}, reverse=True)))
              for w, r in sorted({(c.workers, c.rate) for c in table})]
    plot(results, goal, panels, results_dir / "time_to_accuracy.png")
    summary = {"targets": {str(w): g for w, g in goal.items()}, "claims": claim, "compute_share": share,
               "stops_paying_at_1gbit": {str(w): v for w, v in paying.items()}, "validation": checks,
               "planner": planners, "plan": plan,
               "cells": [{**c.as_record(), **ups[(c.workers, c.rate, c.arm)]} for c in table],
               "headline": {"best_ours_at_8_workers_100mbit": claim["best_ours"], "vs_dense": claim["vs_dense"],
                            "vs_best_baseline": claim["vs_best_baseline"],
                            "communication_share": None if share is None else share["share"], "status": status}}
    results["summary"] = summary
    path.write_text(json.dumps(results, indent=1))
    return summary
