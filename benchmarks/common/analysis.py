"""Reading the accuracy benchmarks' runs: means over seeds, and differences between two arms
paired by seed with a 95% t interval (the runs of one seed share initial weights and batches,
so pairing removes the seed-to-seed spread that both arms share)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from scipy import stats as scipy_stats


def summarize(runs: list[dict]) -> dict[tuple[str, str], dict]:
    """(task, arm) -> seeds, mean and std of the final metric, mean volume, wall time and curve."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["task"], run["arm"]), []).append(run)
    summary = {}
    for key, group in groups.items():
        finals = [r["final"] for r in group]
        summary[key] = {
            "family": group[0]["family"], "metric": group[0]["metric"], "seeds": len(group),
            "mean": statistics.fmean(finals), "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "volume": statistics.fmean(r["volume"] for r in group),
            "wall_s": statistics.fmean(r["wall_s"] for r in group),
            "curve": [statistics.fmean(values) for values in zip(*(r["curve"] for r in group), strict=True)],
        }
    return summary


@dataclass
class Paired:
    """``arm - reference`` over the seeds both ran: mean and its 95% t interval."""

    mean: float
    low: float
    high: float
    seeds: int

    def verdict(self, expected_sign: float | None = None) -> str:
        """``within noise`` if the interval holds 0; else ``better``/``worse`` (higher is better),
        or, given the sign a paper reports, ``same direction``/``opposite``."""
        if not self.low > 0 and not self.high < 0:
            return "within noise"
        if expected_sign is None:
            return "better" if self.low > 0 else "worse"
        return "same direction" if (self.low > 0) == (expected_sign > 0) else "opposite"

    def __str__(self) -> str:
        return f"{100 * self.mean:+.2f} [{100 * self.low:+.2f}, {100 * self.high:+.2f}]"


def paired(runs: list[dict[str, Any]], arm: str, reference: str, value: str = "final",
           index: int | None = None) -> Paired:
    """``arm - reference`` paired by seed, of ``run[value]`` (its ``index``-th entry if given)."""
    def by_seed(name: str) -> dict[int, float]:
        return {r["seed"]: (r[value] if index is None else r[value][index]) for r in runs if r["arm"] == name}

    mine, theirs = by_seed(arm), by_seed(reference)
    differences = [mine[s] - theirs[s] for s in sorted(mine.keys() & theirs.keys())]
    if len(differences) < 2:
        mean = differences[0] if differences else math.nan
        return Paired(mean, -math.inf, math.inf, len(differences))
    mean = statistics.fmean(differences)
    half = scipy_stats.t.ppf(0.975, len(differences) - 1) * statistics.stdev(differences) / math.sqrt(len(differences))
    return Paired(mean, mean - half, mean + half, len(differences))
