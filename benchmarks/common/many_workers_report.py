"""The report of the many-workers study (``benchmarks/accuracy/many_workers.py``): tables, verdicts in
``paper_tables``' words, the time-to-accuracy projection, and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.analysis import Paired, paired

UNIFORM, DENSE = "uniform Top-0.1% + EF", "dense"
LEGACY = ("LEGACY layer + EF", "LEGACY epoch + EF")
#: The projection's links (bytes per second, seconds per collective step) and stated compute time.
LINKS = {"10 Gbit/s, 20 us": (10e9 / 8, 20e-6), "100 Gbit/s, 5 us": (100e9 / 8, 5e-6)}
COMPUTE_S = 0.010
PROJECTED_AT = 128
#: The target accuracy of the projection: this share of dense's final accuracy at PROJECTED_AT.
TARGET_SHARE = 0.95


def _at(runs: list[dict], workers: int) -> list[dict]:
    return [r for r in runs if r["workers"] == workers]


def _across(runs: list[dict], arm: str, low: int, high: int) -> Paired:
    """``arm`` at ``high`` workers minus at ``low``, paired by seed (same weights and batches)."""
    relabelled = [{**r, "arm": f"{r['workers']}"} for r in runs if r["arm"] == arm and r["workers"] in (low, high)]
    return paired(relabelled, str(high), str(low))


def _drop_difference(runs: list[dict], arm: str, low: int, high: int) -> Paired:
    """(``arm``'s change from ``low`` to ``high`` workers) minus uniform's, paired by seed."""
    def change(name: str) -> dict[int, float]:
        at = {(r["workers"], r["seed"]): r["final"] for r in runs if r["arm"] == name}
        return {s: at[(high, s)] - at[(low, s)] for (w, s) in at if w == low and (high, s) in at}

    mine, theirs = change(arm), change(UNIFORM)
    relabelled = [{"arm": label, "seed": s, "final": v} for label, values in (("a", mine), ("u", theirs))
                  for s, v in values.items()]
    return paired(relabelled, "a", "u")


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _arms(runs: list[dict]) -> list[str]:
    from benchmarks.common.simulated import ARMS

    present = {r["arm"] for r in runs}
    return [a.name for a in ARMS if a.name in present]


def _table(runs: list[dict], workers: int, global_batch: int) -> list[str]:
    here = _at(runs, workers)
    lines = [f"### {workers} workers ({here[0]['steps_per_epoch']} steps an epoch, {global_batch // workers} "
             "samples a worker a step)", "",
             f"| arm | seeds | measured volume | accuracy % (mean +- std) | vs {UNIFORM} | vs dense | "
             "routes (worker 0) |",
             "|---|---|---|---|---|---|---|"]
    for arm in _arms(here):
        mine = [r for r in here if r["arm"] == arm]
        finals = [r["final"] for r in mine]
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        vs_uniform = "reference" if arm == UNIFORM else str(paired(here, arm, UNIFORM))
        vs_dense = "reference" if arm == DENSE else str(paired(here, arm, DENSE))
        routes = ", ".join(f"{k} {v}" for k, v in sorted(mine[0]["routes"].items()))
        lines.append(f"| {arm} | {len(mine)} | {_mean([r['volume'] for r in mine]):.4f} | {100 * _mean(finals):.2f} +- "
                     f"{100 * spread:.2f} | {vs_uniform} | {vs_dense} | {routes} |")
    return [*lines, ""]


def _claim(runs: list[dict], low: int, high: int) -> list[str]:
    """The abstract's sentence at the largest count simulated, in paper_tables' verdict words."""
    here = _at(runs, high)
    room = paired(here, DENSE, UNIFORM)
    shows = ("a difference can show" if room.low > 0 else
             "none measurable: its interval holds 0, so no schedule can show a win over uniform here")
    lines = ["## The 100-worker sentence", "",
             "The LEGACY abstract: *\"we evaluate LEGACY under constrained and federated settings, and demonstrate "
             "that it scales effectively to a 100-worker configuration while maintaining strong accuracy under "
             f"aggressive compression\"*. Tested at {high} workers against uniform Top-0.1% + EF at the same link "
             f"bytes. **Headroom** at {high} workers (dense - uniform, paired by seed, 95% interval): {room} points; "
             f"{shows}. Verdicts: *better* / *worse* when the 95% interval excludes 0, else *within noise*.", "",
             f"| LEGACY arm | vs uniform at {high} (byte-matched) | verdict | vs dense at {high} | change {low} -> "
             f"{high} workers | its change minus uniform's | verdict |", "|---|---|---|---|---|---|---|"]
    for arm in LEGACY:
        if not any(r["arm"] == arm for r in here):
            continue
        versus, dense = paired(here, arm, UNIFORM), paired(here, arm, DENSE)
        change, relative = _across(runs, arm, low, high), _drop_difference(runs, arm, low, high)
        lines.append(f"| {arm} | {versus} | {versus.verdict()} | {dense} | {change} | {relative} | "
                     f"{relative.verdict()} |")
    change = _across(runs, UNIFORM, low, high)
    lines += ["", f"Uniform's own change from {low} to {high} workers: {change} points ({change.verdict()}); "
              f"dense's: {_across(runs, DENSE, low, high)}.", "", _conclusion(runs, low, high, room), ""]
    return lines


def _conclusion(runs: list[dict], low: int, high: int, room: Paired) -> str:
    """The sentence's two parts, each arm: accuracy kept from ``low`` to ``high`` workers (its change
    not below 0 beyond noise), and strong under aggressive compression (ahead of, or level with,
    uniform at the same bytes, where a difference can show)."""
    here = _at(runs, high)
    parts = []
    for arm in LEGACY:
        if not any(r["arm"] == arm for r in here):
            continue
        kept = _across(runs, arm, low, high).verdict() != "worse"
        versus = paired(here, arm, UNIFORM).verdict()
        parts.append(f"{arm} {'keeps' if kept else 'loses'} its accuracy from {low} to {high} workers and is "
                     f"{versus if versus == 'within noise' else versus + ' than'}"
                     f"{' of' if versus == 'within noise' else ''} uniform at equal bytes there")
    verdict = ("**Verdict**: " + "; ".join(parts) + "." if parts else "")
    if room.low <= 0:
        verdict += " With no headroom, *strong accuracy* cannot be told apart from uniform's here."
    return verdict


def _routes(runs: list[dict], counts: list[int], two_phase_from: int) -> list[str]:
    lines = ["## Gathered against two-phase", "", "Two-phase minus gathered, paired by seed (points, 95%): the "
             "owners' second compression against the union of every worker's payload (Top-0.1% + EF: against "
             f"{UNIFORM}, the default route: gathered, or dense where that moves fewer bytes). The rows *owners' "
             "feedback dropped minus kept*: the two-phase route with the owners' error feedback dropped "
             "(`ScatterGather(owner_feedback=False)`) minus kept (the default).", "",
             "| compressor | " + " | ".join(f"{w} workers" for w in counts) + " |",
             "|---|" + "---|" * len(counts)]
    for name, arm, against in (("QSGD s=2", "QSGD s=2 two-phase", "QSGD s=2 gathered"),
                               ("EF-signSGD", "EF-signSGD two-phase", "EF-signSGD gathered"),
                               ("EF-signSGD, no owner feedback", "EF-signSGD two-phase, no owner feedback",
                                "EF-signSGD gathered"),
                               ("EF-signSGD two-phase: owners' feedback dropped minus kept",
                                "EF-signSGD two-phase, no owner feedback", "EF-signSGD two-phase"),
                               ("Top-0.1% + EF", "Top-0.1% + EF two-phase", UNIFORM),
                               ("Top-0.1% + EF, no owner feedback", "Top-0.1% + EF two-phase, no owner feedback",
                                UNIFORM),
                               ("Top-0.1% + EF two-phase: owners' feedback dropped minus kept",
                                "Top-0.1% + EF two-phase, no owner feedback", "Top-0.1% + EF two-phase")):
        cells = []
        for w in counts:
            pair = paired(_at(runs, w), arm, against)
            cells.append(f"{pair} {pair.verdict()}" if pair.seeds else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    missing = [w for w in counts
               if w >= two_phase_from and not any(r["workers"] == w and r["route"] == "scattergather" for r in runs)]
    if missing:
        timed = [r for r in runs if r["route"] == "scattergather" and "wall_s" in r]
        widest = max((r["workers"] for r in timed), default=None)
        took = "" if widest is None else (
            f" (here a two-phase run at {widest} workers took a median "
            f"{statistics.median(r['wall_s'] for r in timed if r['workers'] == widest) / 60:.0f} minutes)")
        lines += ["", f"*-*: no two-phase runs at {', '.join(map(str, missing))} workers. On this route every "
                  "simulated worker compresses a segment for each of the W owners, so a step's work grows as "
                  f"W^2{took}: `many_workers` runs those only when `--arms` names them."]
    return [*lines, ""]


def projection(runs: list[dict]) -> tuple[float, list[dict[str, Any]]]:
    """Time to accuracy at PROJECTED_AT workers: the target, and per arm its steps to it and, per
    link, its planned link time per step and the projected time."""
    from benchmarks.common.simulated import ARM, Setting
    from benchmarks.common.tasks import SignalMLP
    from grace_legacy.planner import link_time, plan

    here = _at(runs, PROJECTED_AT)
    target = TARGET_SHARE * _mean([r["final"] for r in here if r["arm"] == DENSE])
    model, setting = SignalMLP(), Setting()
    rows = []
    for arm in _arms(here):
        mine = [r for r in here if r["arm"] == arm]
        curve = [_mean(list(values)) for values in zip(*(r["curve"] for r in mine), strict=True)]
        reached = next((epoch + 1 for epoch, value in enumerate(curve) if value >= target), None)
        steps = None if reached is None else reached * mine[0]["steps_per_epoch"]
        grace = ARM[arm].build(model, setting, PROJECTED_AT, mine[0]["steps_per_epoch"])
        route = ARM[arm].route if ARM[arm].route in ("allgather", "scattergather") else None
        planned = plan(grace.compressor, model.named_parameters(), world_size=PROJECTED_AT, route=route,
                       dense_fallback=grace.dense_fallback)
        links = {label: link_time(planned, bandwidth, latency).total_s for label, (bandwidth, latency) in LINKS.items()}
        rows.append({"arm": arm, "steps": steps, "link_s": links,
                     "time_s": {k: None if steps is None else steps * (COMPUTE_S + v) for k, v in links.items()}})
    return target, rows


def _projection_lines(runs: list[dict]) -> list[str]:
    if not any(r["workers"] == PROJECTED_AT and r["arm"] == DENSE for r in runs):
        return []
    target, rows = projection(runs)
    lines = [f"## Time to accuracy at {PROJECTED_AT} workers, on paper", "",
             f"Simulated steps to {100 * target:.2f}% test accuracy ({TARGET_SHARE:.0%} of dense's final accuracy "
             f"at {PROJECTED_AT} workers; the mean curve over seeds, checked once an epoch) times the step time "
             f"`T_c + T_l`: a stated compute time `T_c` = {1e3 * COMPUTE_S:g} ms a step, and the planner's alpha-beta "
             f"link time `T_l` (`grace_legacy.planner.link_time` of the arm's `plan` at {PROJECTED_AT} workers, as "
             "`python -m grace_legacy plan --bandwidth ... --latency ...` prints it), no overlap with the backward "
             "pass (docs/SIMULATION.md).", "",
             "| arm | steps to target | " + " | ".join(f"T_l, {k} (ms) | time, {k} (s)" for k in LINKS) + " |",
             "|---|---|" + "---|---|" * len(LINKS)]
    for row in rows:
        cells = [f"{1e3 * row['link_s'][k]:.2f} | " + ("not reached" if row["time_s"][k] is None
                                                     else f"{row['time_s'][k]:.2f}") for k in LINKS]
        lines.append(f"| {row['arm']} | {row['steps'] or 'not reached'} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _plot(runs: list[dict], counts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, arm in enumerate(_arms(runs)):
        color = f"C{index}"  # one colour an arm in both panels
        xs = [w for w in counts if any(r["arm"] == arm and r["workers"] == w for r in runs)]
        means = [100 * _mean([r["final"] for r in _at(runs, w) if r["arm"] == arm]) for w in xs]
        left.plot(xs, means, "o-", label=arm, color=color)
        if arm != UNIFORM:
            pairs = [(w, paired(_at(runs, w), arm, UNIFORM)) for w in xs]
            pairs = [(w, p) for w, p in pairs if p.seeds > 1]
            below = [100 * (p.mean - p.low) for _, p in pairs]
            above = [100 * (p.high - p.mean) for _, p in pairs]
            right.errorbar([w for w, _ in pairs], [100 * p.mean for _, p in pairs], yerr=[below, above], fmt="o-",
                           capsize=3, label=arm, color=color)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("workers")
    left.set_ylabel("test accuracy (%), mean over seeds")
    right.axhline(0, color="gray", linewidth=0.8)
    right.set_ylabel(f"accuracy - {UNIFORM} (points, paired 95%)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_report(data: dict[str, Any], results: Path, name: str, two_phase_from: int) -> None:
    """The report of ``data``; ``two_phase_from``: the fewest workers at which the two-phase arms run
    only when named (their absence from there on is said, not left as unfinished)."""
    runs = data["runs"]
    counts = sorted({r["workers"] for r in runs})
    setting = data.get("setting", {})
    lines = ["# Accuracy against the number of workers, simulated", "",
             f"`python -m benchmarks.accuracy.{name}` (in parts: each launch adds the runs the JSON lacked). "
             f"mnist1d ({data['data'][0]:,} train / {data['data'][1]:,} test signals), its MLP, a global batch of "
             f"{setting.get('global_batch')} split among the workers, {setting.get('epochs')} epochs, SGD (momentum "
             f"{setting.get('momentum')}, weight decay {setting.get('weight_decay')}) at {setting.get('lr')} divided "
             f"by {setting.get('decay')} at {', '.join(f'{m:.0%}' for m in setting.get('milestones', []))} of the run; "
             "every worker simulated by `grace_legacy.simulate` with its own compressor and memory, each route's own "
             "code (docs/SIMULATION.md). Launches:", "", *[f"- {launch}" for launch in data["launches"]], "",
             "Arms: uniform Top-0.1% + EF on the default route (a gather, dense where cheaper); LEGACY Top-k by layer "
             "(small tensors 10x the density) and by epoch (thirds at 2x, 1x, 0.5x), each budget-matched to it in "
             "link bytes at that many workers (`Legacy.budget_matched(world_size=W)`); QSGD s=2 (no error feedback) "
             "and EF-signSGD with every tensor gathered or two-phase; dense. Accuracy in %, differences in "
             "percentage points paired by seed with a 95% t interval; measured volume: wire bytes over a dense "
             "ring allreduce's, mean over workers and seeds.", ""]
    if len(counts) > 1 and any(r["arm"] in LEGACY for r in _at(runs, counts[-1])):
        lines += _claim(runs, counts[0], counts[-1])
    lines += ["## Every arm at every number of workers", ""]
    for workers in counts:
        lines += _table(runs, workers, setting.get("global_batch", 0))
    lines += _routes(runs, counts, two_phase_from) + _projection_lines(runs)
    big = [r for r in runs if r["workers"] == counts[-1] and r["arm"] == UNIFORM]
    if big:
        memory = big[0]["memory"]
        lines += [f"Memory at {counts[-1]} workers ({UNIFORM}, one run): the workers' compression state "
                  f"{memory['state_total'] / 2**20:.1f} MiB (the largest worker's {memory['state_max'] / 2**10:.0f} "
                  f"KiB), a step's {counts[-1]} gradients {memory['gradients'] / 2**20:.1f} MiB, for a model of "
                  f"{memory['model'] / 2**10:.0f} KiB.", ""]
    lines += [f"![accuracy against workers]({name}.png)", ""]
    results.mkdir(parents=True, exist_ok=True)
    _plot(runs, counts, results / f"{name}.png")
    (results / f"{name}.md").write_text("\n".join(lines))
    print(f"wrote {results / f'{name}.md'}")
