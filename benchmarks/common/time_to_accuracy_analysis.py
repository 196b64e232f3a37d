"""The time-to-accuracy benchmark's statistics, from its results file
(:mod:`benchmarks.accuracy.time_to_accuracy`): the target, each run's time and steps to it, the
medians over seeds, the speed-ups, the projections from step timing and their validation, the
issue's targets and the planner's ranking. Nothing here is typed in: a run that never reached the
target has no time, and every figure that would need one says so.

* **Target**: at each worker count, the median over the dense fp32 runs (every seed and rate: the
  rate does not change the arithmetic) of the mean accuracy of their last :data:`FINAL_EVALS`
  evaluations, less the margin.
* **Time to target** of a run: its training clock at the first evaluation at or above the target
  (an upper bound by at most one evaluation interval); its steps likewise.
* **Median over seeds**: runs that never reached the target count as later than any that did, so
  the median is a time only if more than half reached it; the interval is the range over seeds.
* **Projected** time of a run at another rate: its steps to target times the median step there.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common.limited_link import COMPUTE
from benchmarks.common.time_to_accuracy_arms import (
    ARMS,
    BASELINE,
    DENSE,
    DENSE_ROLE,
    OURS,
    Setting,
    planned,
    wide_mlp,
)

FINAL_EVALS = 3
#: The issue's targets at 100 Mbit/s and 8 workers.
CLAIM_WORKERS, CLAIM_RATE = 8, 1e8
VS_DENSE, VS_BASELINE = 3.0, 1.3
#: A projection agrees with the real runs within this fraction; the planner's pick is this close to the fastest.
PROJECTION_TOLERANCE = 0.15
PLANNER_TOLERANCE = 0.10
#: Step timing only, on links faster than these workers' cores can fill: each arm's step where the
#: link is no limit, the floor of its step at the tested rates (the planner check's second reading).
FLOOR_RATE = 1e10
LEGACY, UNIFORM = "LEGACY layer + EF two-phase", "Top-k + EF two-phase"


def final_accuracy(run: dict[str, Any]) -> float:
    return statistics.fmean(point[2] for point in run["curve"][-FINAL_EVALS:])


def targets(runs: list[dict[str, Any]], margin_points: float) -> dict[int, dict[str, float]]:
    """Per worker count with dense fp32 runs that used their whole budget: their final accuracy
    (the median over runs) and the target, that less ``margin_points`` percentage points."""
    out: dict[int, dict[str, float]] = {}
    for workers in sorted({run["workers"] for run in runs}):
        finals = [final_accuracy(r) for r in runs
                  if r["arm"] == DENSE and r["workers"] == workers and r["stopped_by"] == "budget"]
        if finals:
            final = statistics.median(finals)
            out[workers] = {"dense_final": final, "target": final - margin_points / 100, "dense_runs": len(finals)}
    return out


def reached(run: dict[str, Any], target: float) -> tuple[int, float] | None:
    """(steps, clock seconds) at the run's first evaluation at or above ``target``; ``None`` if none."""
    return next(((step, clock) for step, clock, accuracy in run["curve"] if accuracy >= target), None)


def median_or_none(values: list[float | None]) -> float | None:
    """The median with ``None`` (never reached) above every number; ``None`` if the median is one."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    n = len(ordered)
    if n % 2:
        return ordered[n // 2]
    low, high = ordered[n // 2 - 1], ordered[n // 2]
    return None if low is None or high is None else (low + high) / 2


def timing_of(timings: list[dict[str, Any]], framework: str, workers: int, rate: float) -> dict[str, Any] | None:
    return next((t for t in timings if (t["framework"], t["workers"], t["rate"]) == (framework, workers, rate)), None)


def median_step(timing: dict[str, Any] | None, name: str) -> float | None:
    if timing is None or name not in timing["ways"]:
        return None
    return statistics.median(timing["ways"][name]["step_s"])


@dataclass
class Cell:
    """One arm at one worker count and rate: times and steps to target by seed (``None``: never)."""

    arm: str
    workers: int
    rate: float
    source: str                                   # "real" or "projected"
    times: dict[int, float | None] = field(default_factory=dict)
    steps: dict[int, int | None] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)
    budget_s: dict[int, float] = field(default_factory=dict)     # real runs: the clock and steps they ended at
    budget_steps: dict[int, int] = field(default_factory=dict)
    run_step_s: float | None = None               # real runs: clock / steps, the median over seeds
    timed_step_s: float | None = None             # the launch's step timing, median
    link_bytes: float | None = None               # per step, busiest link, from the counters
    volume: float | None = None
    projected: float | None = None                # the projection's median where the runs are real

    @property
    def median_s(self) -> float | None:
        return median_or_none(list(self.times.values()))

    @property
    def median_steps(self) -> float | None:
        return median_or_none([None if s is None else float(s) for s in self.steps.values()])

    @property
    def range_s(self) -> tuple[float | None, float | None]:
        values = list(self.times.values())
        numbers = [v for v in values if v is not None]
        return (min(numbers) if numbers else None, None if None in values or not numbers else max(numbers))

    @property
    def reached_seeds(self) -> int:
        return sum(v is not None for v in self.times.values())

    def as_record(self) -> dict[str, Any]:
        """The cell for JSON: the by-seed fields keyed by the seed as text, the medians added."""
        record = {key: ({str(seed): v for seed, v in value.items()} if isinstance(value, dict) else value)
                  for key, value in vars(self).items()}
        return {**record, "median_s": self.median_s, "median_steps": self.median_steps}


def _runs_of(runs: list[dict[str, Any]], arm: str, workers: int, rate: float | None = None) -> list[dict[str, Any]]:
    return [r for r in runs if r["arm"] == arm and r["workers"] == workers and (rate is None or r["rate"] == rate)]


def _projection(runs: list[dict[str, Any]], target: float) -> dict[int, int | None]:
    """Steps to target by seed (a seed's first run where it has several, at several rates)."""
    out: dict[int, int | None] = {}
    for run in runs:
        hit = reached(run, target)
        out.setdefault(run["seed"], None if hit is None else hit[0])
    return out


def _times(steps: dict[int, int | None], step_s: float) -> dict[int, float | None]:
    return {seed: None if n is None else n * step_s for seed, n in steps.items()}


def cells(results: dict[str, Any], goal: dict[int, dict[str, float]]) -> list[Cell]:
    """A cell per arm, worker count and rate with real runs or step timing (and runs at that worker
    count to take steps from), in the arms' order."""
    runs, timings = results["runs"], [t for t in results["timings"] if t["rate"] != FLOOR_RATE]
    configs = sorted({(r["workers"], r["rate"]) for r in runs} | {(t["workers"], t["rate"]) for t in timings})
    out = []
    for workers, rate in configs:
        if workers not in goal:
            continue
        target = goal[workers]["target"]
        for arm in ARMS.values():
            real = _runs_of(runs, arm.name, workers, rate)
            timed = median_step(timing_of(timings, arm.framework, workers, rate), arm.name)
            same_workers = _runs_of(runs, arm.name, workers)
            if not real and (timed is None or not same_workers):
                continue
            cell = Cell(arm.name, workers, rate, "real" if real else "projected", timed_step_s=timed)
            if real:
                for run in real:
                    hit = reached(run, target)
                    cell.times[run["seed"]] = None if hit is None else hit[1]
                    cell.steps[run["seed"]] = None if hit is None else hit[0]
                    cell.stopped[run["seed"]] = run["stopped_by"]
                    cell.budget_s[run["seed"]] = run["train_s"]
                    cell.budget_steps[run["seed"]] = run["steps"]
                cell.run_step_s = statistics.median(r["train_s"] / r["steps"] for r in real)
                cell.link_bytes = statistics.median(r["link_bytes_per_step"] for r in real)
                volumes = [r["volume"] for r in real if r.get("volume") is not None]
                cell.volume = statistics.fmean(volumes) if volumes else None
                if timed is not None:
                    cell.projected = median_or_none(list(_times(_projection(real, target), timed).values()))
            else:
                cell.steps = _projection(same_workers, target)
                cell.times = _times(cell.steps, timed)
                timing = timing_of(timings, arm.framework, workers, rate)
                cell.link_bytes = statistics.median(timing["ways"][arm.name]["link_bytes"])
            out.append(cell)
    return out


def _at(table: list[Cell], workers: int, rate: float) -> dict[str, Cell]:
    return {c.arm: c for c in table if c.workers == workers and c.rate == rate}


def _fastest(row: dict[str, Cell], role: str, defaults_only: bool = False) -> Cell | None:
    reaching = [c for name, c in row.items() if ARMS[name].role == role and c.median_s is not None
                and not (defaults_only and ARMS[name].matched)]
    return min(reaching, key=lambda c: c.median_s) if reaching else None


def speedups(table: list[Cell]) -> dict[tuple[int, float, str], dict[str, Any]]:
    """Per cell: its median time against the dense reference's (the sooner of Horovod's and DDP's
    dense fp32 allreduce at that worker count and rate), the best baseline's (the soonest of
    Horovod's fp16 and PyTorch's fp16 and PowerSGD hooks there, matched settings included) and the
    best baseline's at its defaults (the matched settings left out)."""
    out = {}
    for workers, rate in sorted({(c.workers, c.rate) for c in table}):
        row = _at(table, workers, rate)
        dense, best = _fastest(row, DENSE_ROLE), _fastest(row, BASELINE)
        default = _fastest(row, BASELINE, defaults_only=True)
        for name, cell in row.items():
            mine = cell.median_s
            out[(workers, rate, name)] = {
                "vs_dense": None if mine is None or dense is None else dense.median_s / mine,
                "dense_reference": None if dense is None else dense.arm,
                "vs_best_baseline": None if mine is None or best is None else best.median_s / mine,
                "best_baseline": None if best is None else best.arm,
                "vs_best_default_baseline": None if mine is None or default is None else default.median_s / mine,
                "best_default_baseline": None if default is None else default.arm}
    return out


def link_share(cell: Cell) -> float | None:
    """The share of ``cell``'s step its busiest link spends carrying the step's bytes at the link's
    rate (the real runs' step where there are some, else the timed one)."""
    step = cell.run_step_s if cell.run_step_s is not None else cell.timed_step_s
    if step is None or cell.link_bytes is None:
        return None
    return min(1.0, cell.link_bytes * 8 / cell.rate / step)


def paired_difference(table: list[Cell], arm: str, reference: str, workers: int, rate: float) -> dict[str, Any]:
    """``arm`` - ``reference`` in time to target, paired by seed (95% t interval over the seeds both
    reached it), and the seeds only one of them reached."""
    from benchmarks.common.analysis import paired

    row = _at(table, workers, rate)
    if arm not in row or reference not in row:
        return {"available": False}
    mine, theirs = row[arm].times, row[reference].times
    both = sorted(s for s in mine.keys() & theirs.keys() if mine[s] is not None and theirs[s] is not None)
    only = {"arm": sorted(s for s in mine.keys() & theirs.keys() if mine[s] is not None and theirs[s] is None),
            "reference": sorted(s for s in mine.keys() & theirs.keys() if mine[s] is None and theirs[s] is not None)}
    records = [{"arm": arm, "seed": s, "t": mine[s]} for s in both] + \
              [{"arm": reference, "seed": s, "t": theirs[s]} for s in both]
    result = paired(records, arm, reference, value="t")
    if only["reference"] or result.low > 0:
        no_later: bool | None = False
    elif only["arm"] or result.high < 0 or result.seeds >= 2:
        no_later = True
    else:  # one seed or none: no interval to judge by
        no_later = None
    return {"available": True, "mean_s": result.mean, "low_s": result.low, "high_s": result.high,
            "seeds": result.seeds, "only_reached": only, "no_later": no_later}


def claims(table: list[Cell], ups: dict[tuple[int, float, str], dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets at 8 workers and 100 Mbit/s, each with its figures and a verdict (``None``
    where what it needs was not measured or not reached)."""
    row = _at(table, CLAIM_WORKERS, CLAIM_RATE)
    ours = [c for name, c in row.items() if ARMS[name].role == OURS and c.median_s is not None]
    best = min(ours, key=lambda c: c.median_s) if ours else None
    figures = ups.get((CLAIM_WORKERS, CLAIM_RATE, best.arm), {}) if best else {}
    vs_dense, vs_baseline = figures.get("vs_dense"), figures.get("vs_best_baseline")
    vs_default = figures.get("vs_best_default_baseline")
    baseline = row.get(figures.get("best_baseline"))
    share = None if baseline is None else link_share(baseline)
    return {"best_ours": None if best is None else best.arm, "source": None if best is None else best.source,
            "dense_reference": figures.get("dense_reference"), "vs_dense": vs_dense,
            "vs_dense_met": None if vs_dense is None else vs_dense >= VS_DENSE,
            "best_baseline": figures.get("best_baseline"), "vs_best_baseline": vs_baseline,
            "vs_best_baseline_met": None if vs_baseline is None else vs_baseline >= VS_BASELINE,
            "best_default_baseline": figures.get("best_default_baseline"), "vs_best_default_baseline": vs_default,
            "vs_best_default_baseline_met": None if vs_default is None else vs_default >= VS_BASELINE,
            # At the best baseline's own steps to target, an arm that put nothing on the link would
            # save at most its link's share of each step: 1 / (1 - share) sooner.
            "best_baseline_link_share": share,
            "bytes_alone_bound": None if share is None or share >= 1 else 1 / (1 - share),
            "legacy_vs_uniform": paired_difference(table, LEGACY, UNIFORM, CLAIM_WORKERS, CLAIM_RATE)}


def compute_share(timing: dict[str, Any] | None) -> dict[str, float] | None:
    """The share of a dense fp32 step not spent computing: 1 - compute-only / dense, the medians, and
    the median over iterations of the same ratio paired with the compute step of the iteration."""
    if timing is None or DENSE not in timing["ways"]:
        return None
    compute, dense = timing["ways"][COMPUTE], timing["ways"][DENSE]
    at = dict(zip(compute["iteration"], compute["step_s"], strict=True))
    paired_shares = [1 - at[i] / s for i, s in zip(dense["iteration"], dense["step_s"], strict=True) if i in at]
    return {"compute_s": statistics.median(compute["step_s"]), "dense_s": statistics.median(dense["step_s"]),
            "share": 1 - statistics.median(compute["step_s"]) / statistics.median(dense["step_s"]),
            "paired_share": statistics.median(paired_shares) if paired_shares else math.nan}


def planner_check(timing: dict[str, Any], widths: list[int], floor: dict[str, Any] | None = None) -> dict[str, Any]:
    """The planner's step estimate per timed arm: :func:`grace_legacy.planner.step_time` with the
    measured compute-only step and the link's rate, the latency of one collective step from the
    measured 8-byte allreduce (its time over a ring allreduce's ``2 (P - 1)`` steps); its pick (see
    :func:`_judged`) against the fastest measured step, and the rank correlation. With ``floor`` (the
    same launch's step timing at :data:`FLOOR_RATE`), the same judged again on each arm's larger of
    its estimate and its step there (``bounded``): on a link that is no limit, a step is what the
    shared cores and the arm's own arithmetic make it, which no slower link can shorten."""
    from grace_legacy.planner import collective_steps, plan, step_time

    workers, rate = timing["workers"], timing["rate"]
    model = wide_mlp(tuple(widths))
    shapes = [p.shape for p in model.parameters()]
    latency = timing["tiny_collective_s"] / max(1, collective_steps("allreduce", workers))
    compute = statistics.median(timing["ways"][COMPUTE]["step_s"])
    rows = {}
    for name in timing["ways"]:
        if name == COMPUTE:
            continue
        compressor, route = planned(ARMS[name], Setting(model, workers))
        estimate = step_time(plan(compressor, shapes, world_size=workers, route=route), rate / 8, latency, compute)
        rows[name] = {"estimate_s": estimate, "measured_s": statistics.median(timing["ways"][name]["step_s"]),
                      "compressor": repr(compressor), "route": route or "default"}
    out = {"framework": timing["framework"], "workers": workers, "rate": rate, "latency_s": latency,
           "compute_s": compute, "rows": rows, **_judged(rows, "estimate_s")}
    floors = {name: median_step(floor, name) for name in rows}
    if floor is not None and None not in floors.values():
        for name, row in rows.items():
            row.update(floor_s=floors[name], bounded_s=max(row["estimate_s"], floors[name]))
        out["bounded"] = _judged(rows, "bounded_s")
    return out


def _judged(rows: dict[str, dict[str, Any]], key: str) -> dict[str, Any]:
    """The pick of an estimate (``rows[name][key]``: the least) held to the fastest measured arm."""
    from scipy.stats import spearmanr

    least = min(r[key] for r in rows.values())
    # Arms the planner cannot tell apart (the same bytes and collectives) are all its pick, the
    # slowest of them held to the fastest measured arm; but what it configures is a bundle of ours,
    # so where one of ours ties with a baseline (the same plan in another library's code), the
    # pick is among ours: a user who follows the planner runs our code, not the baseline's.
    tied = [n for n, r in rows.items() if r[key] <= least * (1 + 1e-9)]
    configurable = [n for n in tied if ARMS[n].role == OURS] or tied
    pick = max(configurable, key=lambda n: rows[n]["measured_s"])
    fastest = min(rows, key=lambda n: rows[n]["measured_s"])
    rho = spearmanr([r[key] for r in rows.values()], [r["measured_s"] for r in rows.values()])[0] \
        if len(rows) > 2 else math.nan
    ratio = rows[pick]["measured_s"] / rows[fastest]["measured_s"]
    return {"pick": pick, "tied": tied, "fastest": fastest, "pick_vs_fastest": ratio,
            "met": ratio <= 1 + PLANNER_TOLERANCE, "spearman": float(rho)}


def planner_checks(timings: list[dict[str, Any]], widths: list[int]) -> list[dict[str, Any]]:
    """:func:`planner_check` at every timed launch but those at :data:`FLOOR_RATE` (no tested link:
    their steps are the others' floors)."""
    return [planner_check(t, widths, timing_of(timings, t["framework"], t["workers"], FLOOR_RATE))
            for t in timings if t["rate"] != FLOOR_RATE]


def validation(table: list[Cell]) -> list[dict[str, Any]]:
    """Where an arm has real runs and step timing: the projected median time against the real one."""
    out = []
    for cell in table:
        if cell.source == "real" and cell.projected is not None and cell.median_s is not None:
            ratio = cell.projected / cell.median_s
            out.append({"arm": cell.arm, "workers": cell.workers, "rate": cell.rate, "real_s": cell.median_s,
                        "projected_s": cell.projected, "ratio": ratio,
                        "within": abs(ratio - 1) <= PROJECTION_TOLERANCE})
    return out


def first_timings(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each launch's first step timing: the earliest set aside for it (``superseded``, in the order
    they were set aside) where it was timed again, else the one it has. The first was made beside
    the launch's first runs, so a projection from it is checked against runs of its own time."""
    first: dict[str, dict[str, Any]] = {}
    for record in results.get("superseded", []):
        if record.get("kind") == "timings":
            first.setdefault(record["key"], record)
    return [first.get(timing["key"], timing) for timing in results["timings"]]


def stops_paying(table: list[Cell], ups: dict[tuple[int, float, str], dict[str, Any]], rate: float = 1e9
                 ) -> dict[int, dict[str, Any]]:
    """At ``rate``, per worker count: our arms that reach the target no sooner than dense fp32, and
    those no sooner than the best baseline (or never); which baseline that is, and whether it ran
    dense throughout."""
    out: dict[int, dict[str, Any]] = {}
    for workers in sorted({c.workers for c in table if c.rate == rate}):
        row = _at(table, workers, rate)
        mine = [c for c in row.values() if ARMS[c.arm].role == OURS]
        figures = {c.arm: ups[(workers, rate, c.arm)] for c in mine}
        best = _fastest(row, BASELINE)
        out[workers] = {
            "not_faster_than_dense": [a for a, f in figures.items() if f["vs_dense"] is None or f["vs_dense"] <= 1],
            "not_faster_than_best_baseline": [a for a, f in figures.items()
                                              if f["vs_best_baseline"] is None or f["vs_best_baseline"] <= 1],
            "best_baseline": None if best is None else best.arm,
            # PyTorch's PowerSGD hook at its defaults never compresses in a run shorter than its
            # warm-up: it is then DDP's dense allreduce, under another name.
            "best_baseline_dense_throughout": best is not None and bool(best.budget_steps)
            and max(best.budget_steps.values()) <= ARMS[best.arm].dense_steps}
    return out
