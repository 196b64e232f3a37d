"""The plans as text and a picture, for ``python -m grace_legacy plan``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from grace_legacy.planner.plan import Cell, Plan
from grace_legacy.planner.timing import Scaling, link_time, step_time


def _show_value(cell: Cell, parameter_name: str) -> str:
    value = cell.parameter
    if parameter_name == "-":  # a compressor without a parameter
        return "-"
    if value is None:
        return "dense"
    text = f"{value:.4g} ({value * 100:.4g}%)" if parameter_name == "ratio" else f"{value:g}"
    return text + ("*" if cell.fallback else "")


def _bytes(n: float) -> str:
    return f"{round(n):,}"


def _mix(routes: Iterable[tuple[str, int]]) -> str:
    return ", ".join(f"{route} {count}" for route, count in routes)


def format_plan(result: Plan) -> str:
    """The table, one row per phase and size group with the routes its tensors take, a total per
    phase, and the last line ``expected volume X%`` (the wire volume at ``result.world_size``)."""
    header = (f"{'phase':<18} {'size group':<22} {'tensors':>7} {'elements':>12} {result.parameter_name:>20} "
              f"{'link bytes/step':>16} {'dense link':>16} {'volume':>8}  routes")
    lines = [header, "-" * len(header)]
    for phase, label in enumerate(result.phase_labels):
        cells = [c for c in result.cells if c.phase == phase]
        for cell in cells:
            lines.append(f"{label:<18} {result.group_labels[cell.group]:<22} {cell.tensors:>7} "
                         f"{cell.elements:>12,} {_show_value(cell, result.parameter_name):>20} "
                         f"{_bytes(cell.link_bytes):>16} {_bytes(cell.link_dense):>16} {cell.volume:>8.2%}  "
                         f"{_mix(cell.routes)}")
        link, dense = result.phase_totals(phase)
        share = result.phase_weights[phase]
        routes = Counter()
        for cell in cells:
            routes.update(dict(cell.routes))
        lines.append(f"{label:<18} {'all (' + format(share, '.0%') + ' of run)':<22} "
                     f"{sum(c.tensors for c in cells):>7} {sum(c.elements for c in cells):>12,} {'':>20} "
                     f"{_bytes(link):>16} {_bytes(dense):>16} {link / dense if dense else 0:>8.2%}  "
                     f"{_mix(sorted(routes.items()))}")
    if any(c.fallback for c in result.cells):
        lines.append("* dense-fallback: sent dense, as no compressed route would move fewer link bytes")
    if result.world_size == 1:
        lines.append("one worker: nothing crosses a link; bytes handed to the collectives against the dense bytes")
    lines.append(f"expected volume {result.volume:.2%}")
    return "\n".join(lines)


def format_scaling(rows: Sequence[Scaling]) -> str:
    """One line per worker count: the wire volume of each route alone, of the default bundle's
    choice and of the byte-optimal one (``communicator="auto"``), side by side, and their routes."""
    routes = list(rows[0].forced)
    header = (f"{'workers':>7} " + " ".join(f"{r:>13}" for r in routes)
              + f" {'default':>9} {'auto':>9}  default routes | auto routes")
    lines = [header, "-" * len(header)]
    for row in rows:
        auto_mix = "same" if row.auto.route_mix() == row.chosen.route_mix() else row.auto.route_mix()
        lines.append(f"{row.world_size:>7} " + " ".join(f"{row.forced[r].volume:>13.2%}" for r in routes)
                     + f" {row.chosen.volume:>9.2%} {row.auto.volume:>9.2%}  {row.chosen.route_mix()} | {auto_mix}")
    return "\n".join(lines)


def format_link_times(routes: dict[str, Plan], bandwidth: float, latency: float, compute: float | None = None) -> str:
    """The alpha-beta estimate of each route's communication time per step
    (:mod:`grace_legacy.planner.timing`): ``routes`` maps a label (``dense``, ``allgather``,
    ``chosen``...) to its plan; with ``compute`` (seconds), each route's estimated step too."""
    world_size = next(iter(routes.values())).world_size
    lines = [f"link time per step at {world_size} workers, {bandwidth:.6g} bytes/s per link, "
             f"{latency:.6g} s per collective step (ring allreduce 2(P-1) steps, allgather and all-to-all P-1)"
             + ("" if compute is None else f"; step = {compute:.6g} s of compute, then the link time") + ":"]
    header = (f"{'route':<14} {'collectives':>11} {'steps':>9} {'link bytes':>16} {'latency s':>11} "
              f"{'transfer s':>11} {'total s':>11}" + ("" if compute is None else f" {'step s':>11}"))
    lines += [header, "-" * len(header)]
    for label, result in routes.items():
        time = link_time(result, bandwidth, latency)
        link = sum(w * result.phase_totals(p)[0] for p, w in enumerate(result.phase_weights))
        lines.append(f"{label:<14} {time.collectives:>11.4g} {time.steps:>9.6g} {_bytes(link):>16} "
                     f"{time.latency_s:>11.4g} {time.transfer_s:>11.4g} {time.total_s:>11.4g}"
                     + ("" if compute is None else f" {step_time(result, bandwidth, latency, compute):>11.4g}"))
    return "\n".join(lines)


def plot_scaling(rows: Sequence[Scaling], path: str, title: str = "", mark: int | None = None) -> None:
    """Wire volume against the number of workers (log x), per route alone and for the bundle's
    choice, beside dense (1), with a line at ``mark`` workers; saved as PNG."""
    import matplotlib  # an optional dependency (the `examples` extra), needed only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    workers = [row.world_size for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # The bundle's choices first, wide and pale, so that the routes they follow show through.
    ax.plot(workers, [row.chosen.volume for row in rows], color="black", linewidth=6, alpha=0.25,
            label="default bundle")
    ax.plot(workers, [row.auto.volume for row in rows], color="tab:purple", linewidth=6, alpha=0.2,
            label="communicator='auto'")
    ax.plot(workers, [1.0] * len(workers), color="gray", linestyle="--", label="dense allreduce")
    for route in rows[0].forced:
        ax.plot(workers, [row.forced[route].volume for row in rows], marker="o", markersize=4,
                label=f"{route} alone")
    if mark is not None:
        ax.axvline(mark, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.set_xlabel("workers")
    ax.set_ylabel("wire volume (link bytes / dense ring allreduce)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
