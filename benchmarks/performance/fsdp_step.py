"""Step time of a model sharded by FSDP2 over 4 and 8 workers at 1 Gbit/s and 100 Mbit/s: FSDP2's
dense reduce-scatter against grace_legacy.fsdp's compressed one.

    python -m benchmarks.performance.fsdp_step            # the full run (needs root)
    python -m benchmarks.performance.fsdp_step --quick    # a smoke run: 2 workers, a tiny model

Every worker is a plain ``torch.distributed`` process (Gloo over TCP) in its own Linux network
namespace, on veth links to a bridge rate limited in both directions with ``tc``
(:mod:`benchmarks.common.netns`); the rate changes between phases while the workers keep running
(:mod:`benchmarks.common.limited_link`). Each worker trains the MLP of
:func:`benchmarks.common.step_models.build` (``"mlp"``: 6.3M parameters, little compute) with each
Linear layer and the whole model ``fully_shard``-ed, five ways, interleaved step by step:

* *compute only*: the unsharded model on the same batch, no communication (the bound's compute);
* *dense*: FSDP2's own reduce-scatter;
* *QSGD(64)*, *U8bit* (both memory-free, 1 byte an element) and *Top-k 0.01 + EF*
  (``Grace(TopK(0.01), memory=Residual())``) through ``grace_legacy.fsdp.register``.

A step is timed from the forward pass to the end of ``optimizer.step()`` on every rank after a
barrier; the slowest rank counts. *Wire* is what the step must put on a rank's link with
bandwidth-optimal collectives: FSDP2's parameter all-gathers, ``(P - 1)`` padded parameter shards
per gather (before each unit's forward, and again before its backward where FSDP2 reshards after
the forward: every unit but the root), plus the reduce-scatter: ``(P - 1)`` padded gradient shards
for dense, the bytes grace_legacy counts for the compressed ways (``stats["wire_bytes"]``). Each
step is held to its own iteration's lower bound ``compute + wire / rate``; the all-gather's share
of the wire says how much of a step no gradient compression can touch. *Link*: the bytes the
busiest rank's interface counted. Results: ``benchmarks/results/fsdp_step.md``, ``.json``, ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import limited_link
from benchmarks.common.limited_link import COMPUTE, interleave, label, plan_steps, request_rate, timed_on_link
from benchmarks.common.worker_exit import end_worker

WORKERS = (4, 8)
QUICK_WORKERS = (2,)
RATES = [1e9, 1e8]
DENSE = "dense"
WAYS = (COMPUTE, DENSE, "QSGD(64)", "U8bit", "Top-k 0.01 + EF")
LEARNING_RATE = 1e-3


def compression_of(name: str) -> Any:
    from grace_legacy import QSGD, Grace, Residual, TopK, U8bit

    return {"QSGD(64)": lambda: QSGD(64), "U8bit": U8bit,
            "Top-k 0.01 + EF": lambda: Grace(TopK(0.01), memory=Residual())}[name]()


@dataclass
class Way:
    name: str
    step_model: Any
    optimizer: Any
    state: Any = None

    def step(self) -> float:
        """One training step; returns when its backward pass ended."""
        self.optimizer.zero_grad()
        self.step_model.loss().backward()
        backward_done = time.perf_counter()
        self.optimizer.step()
        return backward_done


def shard(model: Any, mesh: Any) -> list[Any]:
    """``fully_shard`` each child holding parameters, then the model: the units, root last."""
    from torch.distributed.fsdp import fully_shard

    units = [child for child in model.children() if any(True for _ in child.parameters())]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return [*units, model]


def all_gather_wire(units: list[Any], world: int) -> float:
    """Link bytes per rank of one step's parameter all-gathers: each unit's padded shard to the
    ``P - 1`` others, twice for the units FSDP2 reshards after the forward (all but the root)."""
    total = 0.0
    for index, unit in enumerate(units):
        root = index == len(units) - 1
        shard_bytes = sum(fp.padded_sharded_param_size.numel() * fp.sharded_param.element_size()
                          for group in unit._get_fsdp_state()._fsdp_param_groups for fp in group.fsdp_params)
        total += (1 if root else 2) * (world - 1) * shard_bytes
    return total


def dense_reduce_scatter_wire(units: list[Any], world: int) -> float:
    """FSDP2's own reduce-scatter: each unit's padded gradient shards to the ``P - 1`` others."""
    return float(sum((world - 1) * fp.padded_sharded_param_size.numel() * fp.sharded_param.element_size()
                     for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups
                     for fp in group.fsdp_params))


def build_way(name: str, model: str, quick: bool, rank: int, mesh: Any) -> tuple[Way, list[Any]]:
    import torch

    import grace_legacy.fsdp
    from benchmarks.common.step_models import build

    step_model = build(model, quick, seed=0, data_seed=rank)
    units = [] if name == COMPUTE else shard(step_model.model, mesh)
    state = grace_legacy.fsdp.register(step_model.model, compression_of(name)) if name not in (COMPUTE, DENSE) \
        else None
    return Way(name, step_model, torch.optim.SGD(step_model.model.parameters(), lr=LEARNING_RATE), state), units


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    control = Path(args.control)

    def slowest(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    results: dict[str, Any] = {"workers": world, "models": {}}
    request = 0
    for model in args.models:
        built = {name: build_way(name, model, args.quick, rank, mesh) for name in WAYS}
        ways = {name: way for name, (way, _) in built.items()}
        units = built[DENSE][1]
        gather, dense_scatter = all_gather_wire(units, world), dense_reduce_scatter_wire(units, world)

        def timed_step(name: str, ways: dict[str, Way] = ways, gather: float = gather,
                       dense_scatter: float = dense_scatter) -> dict[str, float]:
            way = ways[name]
            dist.barrier()
            before = way.state.stats.get("wire_bytes", 0.0) if way.state is not None else 0.0
            elapsed, backward, seen = timed_on_link(way.step)
            scatter = {COMPUTE: 0.0, DENSE: dense_scatter}.get(name)
            if scatter is None:
                scatter = way.state.stats["wire_bytes"] - before
            wire = 0.0 if name == COMPUTE else gather + scatter
            step, back, link, wire, scatter = slowest([elapsed, backward, float(seen), wire, scatter])
            return {"step_s": step, "backward_s": back, "link_bytes": link, "wire_bytes": wire,
                    "reduce_scatter_bytes": scatter}

        parameters = sum(p.numel() for p in ways[COMPUTE].step_model.model.parameters())
        record: dict[str, Any] = {"parameters": parameters, "units": len(units), "all_gather_bytes": gather,
                                  "dense_reduce_scatter_bytes": dense_scatter, "rates": {}, "memory": {}}
        for phase, rate in enumerate(args.rates):
            request_rate(control, request, rate, rank == 0, dist.barrier)
            request += 1
            link_s = {name: 0.0 if name == COMPUTE else (gather + dense_scatter) * 8 / rate for name in WAYS}
            plan = plan_steps(link_s, phase == 0, args.warmup, args.steps, args.dense_steps, args.slow_steps)
            record["rates"][repr(rate)] = interleave(plan, timed_step)
            if rank == 0:
                print(f"{model}, {world} workers, {label(rate)}: " + ", ".join(
                    f"{n} {statistics.median(m['step_s']):.3f} s" for n, m in record["rates"][repr(rate)].items()),
                    flush=True)
        record["memory"] = {name: way.state.memory_report() for name, way in ways.items() if way.state is not None}
        results["models"][model] = record
    if rank == 0:
        Path(args.json).write_text(json.dumps(results))
    end_worker()  # FSDP2's own Gloo collectives can abort a finalizing interpreter


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.netns import TorchJob
    from benchmarks.performance.scatter_gather_step import uptime

    runs = {}
    before = uptime()
    for workers in args.workers:
        runs[str(workers)] = limited_link.launch_workers("benchmarks.performance.fsdp_step", args, TorchJob, workers,
                                                         {})
    first = next(iter(runs.values()))
    return {"runs": runs, "machine": first["machine"], "uptime": [before, uptime()],
            "cores": len(os.sched_getaffinity(0))}


def write(result: dict, results_dir: Path, command: str) -> None:
    rows, tables = [], {}
    for workers, run in result["runs"].items():
        table = tables[workers] = limited_link.summarise(run, extra=("backward_s", "link_bytes",
                                                                     "reduce_scatter_bytes"))
        for model, rates in table.items():
            record = run["models"][model]
            gather = record["all_gather_bytes"]
            for rate_key, ways in rates.items():
                for name, row in ways.items():
                    share = "-" if name == COMPUTE else f"{gather / row['wire_bytes']:.0%}"
                    volume = "- | -" if name == COMPUTE else \
                        f"{row['wire_bytes'] / 1e6:.2f} | {row['link_bytes'] / 1e6:.2f}"
                    rows.append(f"| {workers} | {label(float(rate_key))} | {name} | **{row['step_s']:.3f}** | "
                                f"{volume} | {share} | {row['bound_s']:.3f} | {row['vs_bound']:.2f} | "
                                f"{row['speedup_vs_dense']:.2f}x | {row['steps']} |")
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "fsdp_step.json").write_text(json.dumps({**result, "summary": tables}, indent=1))
    first = next(iter(result["runs"].values()))
    model, record = next(iter(first["models"].items()))
    text = f"""# FSDP2 step time: dense reduce-scatter against grace_legacy.fsdp's compressed one

`{command}` (needs root)

Machine: {result['machine']}. Load: `{result['uptime'][0]}` before and `{result['uptime'][1]}` after;
{result['cores']} cores shared by every worker (and by other jobs), so compute and compression are
slower than on separate hosts. Model: {model}, {record['parameters'] / 1e6:.2f}M parameters in
{record['units']} FSDP2 units. Workers: plain `torch.distributed` processes over Gloo TCP, each in its
own network namespace, links limited in both directions with `tc tbf`.

Per way the median over steps of the slowest rank's step; *wire* what the step must put on a rank's
link (FSDP2's parameter all-gathers plus the reduce-scatter; counted by grace_legacy for the
compressed ways), *link* what the busiest interface counted (headers and coordination included);
*all-gather share* the all-gathers' part of the wire (uncompressed: FSDP2's own); *bound*
`compute only + wire / rate`; *vs bound* the median over iterations of each step over its own
iteration's bound; *vs dense* dense's median step over the way's.

| workers | rate | way | step s | wire MB | link MB | all-gather share | bound s | vs bound | vs dense | steps |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

![step time](fsdp_step.png)
"""
    (results_dir / "fsdp_step.md").write_text(text)
    plot(tables, results_dir / "fsdp_step.png")


def plot(tables: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(workers, model, rate_key, ways) for workers, table in tables.items()
              for model, rates in table.items() for rate_key, ways in rates.items()]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (workers, model, rate_key, ways) in zip(axes[0], panels, strict=True):
        names = [name for name in WAYS if name in ways]
        xs = range(len(names))
        axis.bar(xs, [ways[n]["step_s"] for n in names], color="#48c", alpha=0.8, label="step (median)")
        axis.scatter(xs, [ways[n]["bound_s"] for n in names], marker="_", s=600, color="black", zorder=3,
                     label="bound: compute + wire / rate")
        axis.set_xticks(list(xs), [n.replace(" ", "\n", 1) for n in names], fontsize=7)
        axis.set_ylabel("step time (s)")
        axis.set_title(f"{model}, {workers} workers, {label(float(rate_key))}", fontsize=9)
        axis.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = limited_link.parser(__doc__, "2 workers, a tiny model, one rate, two steps: a smoke run", "dense",
                                 "dense")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help=f"default {' '.join(map(str, WORKERS))}")
    parser.set_defaults(models=["mlp"], rates=RATES)
    args = limited_link.parse(parser, full_steps=12)
    if args.workers is None:
        args.workers = list(QUICK_WORKERS if args.quick else WORKERS)
    if args.quick and args.rates == RATES:
        args.rates = RATES[:1]
    if args.worker:
        worker(args)
        return
    limited_link.drive("benchmarks.performance.fsdp_step", args, launch, write, lambda result: {
        workers: {model: {label(float(r)): {n: round(w["step_s"], 3) for n, w in ways.items()}
                          for r, ways in rates.items()}
                  for model, rates in limited_link.summarise(run, extra=()).items()}
        for workers, run in result["runs"].items()})


if __name__ == "__main__":
    main()
