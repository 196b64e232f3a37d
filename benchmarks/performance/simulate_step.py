"""What simulating many workers costs: a step of ``W`` simulated workers against one worker's step on
the same global batch.

    python -m benchmarks.performance.simulate_step            # 128 workers, 2 and 8 samples each (minutes)
    python -m benchmarks.performance.simulate_step --quick    # 8 workers, a smoke run (seconds)
    python -m benchmarks.performance.simulate_step --workers 128 512 --batches 2

The digits CNN (``benchmarks/common/tasks.py``, 8 tensors, 72k parameters) on random 8x8 inputs
(only time is measured), every worker compressing with uniform Top-0.1% + EF on the default route.
Three ways take turns, repetition by repetition, so that drift of a shared machine hits them alike:

* *simulated*: ``Simulation(W workers).backward`` of ``W`` micro-batches of ``b`` samples and the
  optimizer's step; its phases timed by ``Simulation.seconds`` (the vectorised gradients, the
  workers' starts: compression and launches, their finishes: aggregation and end of step);
* *one worker*: the same on one worker with all ``W b`` samples in one batch (one backward pass,
  one rank's compression): what the simulation is compared with;
* *looped gradients*: the ``W`` gradients one worker after another (``vectorize=False``'s cost).

Reported: the median of each, the ratio simulated / one worker with a 95% bootstrap interval of the
median of the paired ratios, the phases, the tensor state the workers keep (``Simulation.memory``)
and the process's peak resident memory. Results: ``benchmarks/results/performance.md`` (section
"simulate_step"), ``simulate_step.json`` and ``simulate_step.png``, with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common.report import RESULTS, load_average, machine, median_interval, update_section
from benchmarks.common.tasks import DigitsCNN
from grace_legacy import Grace, Residual, TopK
from grace_legacy.simulate import Simulation, WorkerGradients

DENSITY = 0.001


def _step(sim: Simulation, optimizer: torch.optim.Optimizer, batches: list) -> float:
    started = time.perf_counter()
    sim.backward(batches)
    optimizer.step()
    return time.perf_counter() - started


def measure(workers: int, batch: int, repetitions: int, warmup: int) -> dict:
    """Interleaved timings of the three ways for ``workers`` workers of ``batch`` samples."""
    g = torch.Generator().manual_seed(0)
    inputs = torch.rand(workers * batch, 1, 8, 8, generator=g)
    targets = torch.randint(0, 10, (workers * batch,), generator=g)
    micro = [(inputs[w * batch:(w + 1) * batch], targets[w * batch:(w + 1) * batch]) for w in range(workers)]
    torch.manual_seed(0)
    model, single = DigitsCNN(), DigitsCNN()
    make = lambda worker: Grace(TopK(DENSITY), memory=Residual())  # noqa: E731
    times: dict[str, list[float]] = {"simulated": [], "one worker": [], "looped gradients": []}
    with Simulation(model, make, workers) as sim, Simulation(single, make, 1) as one:
        optimizers = torch.optim.SGD(model.parameters(), lr=0.01), torch.optim.SGD(single.parameters(), lr=0.01)
        looped = WorkerGradients(model, torch.nn.functional.cross_entropy, vectorize=False)
        for repetition in range(warmup + repetitions):
            if repetition == warmup:
                sim.seconds = dict.fromkeys(sim.seconds, 0.0)
            simulated = _step(sim, optimizers[0], micro)
            whole = _step(one, optimizers[1], [(inputs, targets)])
            started = time.perf_counter()
            looped([x for x, _ in micro], [y for _, y in micro], range(workers))
            loop = time.perf_counter() - started
            if repetition >= warmup:
                for way, seconds in zip(times, (simulated, whole, loop), strict=True):
                    times[way].append(seconds)
        phases = {phase: seconds / repetitions for phase, seconds in sim.seconds.items()}
        memory = sim.memory()
        vectorized = sim.gradients.vectorized
    ratios = [s / o for s, o in zip(times["simulated"], times["one worker"], strict=True)]
    return {"workers": workers, "batch": batch, "vectorized": vectorized,
            "median_s": {way: statistics.median(t) for way, t in times.items()}, "times_s": times,
            "ratio": statistics.median(ratios), "ratio_interval": median_interval(ratios) if len(ratios) > 1 else None,
            "phases_s": phases, "memory": memory}


def write(result: dict, results: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"`{command}` on {result['machine']}; load average {result['load'][0]:.1f} before and "
             f"{result['load'][1]:.1f} after; {result['repetitions']} repetitions after {result['warmup']} warm-up, "
             "interleaved.", "",
             "The digits CNN, Top-0.1% + EF on the default route, random inputs. *Simulated*: a step of W workers "
             "(`Simulation.backward` + the optimizer's step); *one worker*: one rank's step on the W b samples as one "
             "batch; ratio: median of the paired ratios, 95% bootstrap interval.", "",
             "| workers | batch / worker | simulated (ms) | one worker (ms) | ratio | gradients / starts / finishes "
             "(ms) | looped gradients (ms) | workers' state | W gradients |", "|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        m, p, mem = case["median_s"], case["phases_s"], case["memory"]
        interval = case["ratio_interval"]
        ratio = f"{case['ratio']:.1f}x" + (f" [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else "")
        phases = " / ".join(f"{1e3 * p[phase]:.1f}" for phase in ("gradients", "start", "finish"))
        lines.append(f"| {case['workers']} | {case['batch']} | {1e3 * m['simulated']:.1f} | "
                     f"{1e3 * m['one worker']:.1f} | {ratio} | {phases} | {1e3 * m['looped gradients']:.1f} | "
                     f"{mem['state_total'] / 2**20:.1f} MiB | {mem['gradients'] / 2**20:.1f} MiB |")
    lines += ["", f"Peak resident memory of the process: {result['peak_rss_mib']:.0f} MiB. Gradients "
              f"{'vectorised' if all(c['vectorized'] for c in result['cases']) else 'looped (not vectorisable)'}.",
              "", "![simulated step](simulate_step.png)"]
    results.mkdir(parents=True, exist_ok=True)
    (results / "simulate_step.json").write_text(json.dumps(result, indent=1))
    update_section(results / "performance.md", "simulate_step",
                   "## A simulated step: W workers against one worker's step\n\n" + "\n".join(lines),
                   title="Performance results")
    figure, axis = plt.subplots(figsize=(7, 3.5))
    labels = [f"W={c['workers']}, b={c['batch']}" for c in result["cases"]]
    bottom = [0.0] * len(labels)
    for phase in ("gradients", "start", "finish"):
        heights = [1e3 * c["phases_s"][phase] for c in result["cases"]]
        axis.bar(labels, heights, bottom=bottom, label=f"simulated: {phase}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axis.scatter(labels, [1e3 * c["median_s"]["one worker"] for c in result["cases"]], color="black", zorder=3,
                 label="one worker, whole batch")
    axis.set_ylabel("ms per step")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(results / "simulate_step.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--workers", type=int, nargs="+", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="samples per worker")
    parser.add_argument("--repetitions", type=int, default=None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    workers = args.workers or ([8] if args.quick else [128])
    batches = args.batches or ([2] if args.quick else [2, 8])
    repetitions = args.repetitions or (2 if args.quick else 10)
    warmup = 1 if args.quick else 3
    torch.set_num_threads(1)
    load = [load_average()]
    cases = [measure(w, b, repetitions, warmup) for w in workers for b in batches]
    load.append(load_average())
    result = {"machine": machine(), "load": load, "repetitions": repetitions, "warmup": warmup, "cases": cases,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    command = "python -m benchmarks.performance.simulate_step" + (" --quick" if args.quick else "")
    if args.workers:
        command += " --workers " + " ".join(map(str, args.workers))
    if args.batches:
        command += " --batches " + " ".join(map(str, args.batches))
    write(result, args.results, command)
    for case in cases:
        print(f"W={case['workers']} b={case['batch']}: simulated {1e3 * case['median_s']['simulated']:.1f} ms, one "
              f"worker {1e3 * case['median_s']['one worker']:.1f} ms, ratio {case['ratio']:.1f}x")


if __name__ == "__main__":
    main()
