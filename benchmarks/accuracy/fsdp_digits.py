"""FSDP2 on the digits task: accuracy, link bytes and memory of each compression against FSDP2's own.

    python -m benchmarks.accuracy.fsdp_digits            # 4 workers, 20 epochs, five compressions (needs root)
    python -m benchmarks.accuracy.fsdp_digits --quick    # 2 workers, 1 epoch, dense and QSGD: a smoke run

Runs ``examples/train_digits_fsdp.py``'s training (a small CNN, three FSDP2 units, scikit-learn's
digits, each worker a quarter of the training set) once per compression, every worker a plain
``torch.distributed`` process in its own network namespace (:mod:`benchmarks.common.netns`, no rate
limit: the links only count). Per run and rank it records the test accuracy, the TCP payload its
interface sent during training (:func:`benchmarks.common.link_counters.read_link`: FSDP2's parameter
all-gathers, the reduce-scatters and the set-up's few collectives), the reduce-scatter bytes
grace_legacy counts (``stats["wire_bytes"]``, against FSDP2's dense reduce-scatter's ``wire_dense``)
and ``GraceState.memory_report()``. Accuracy and bytes do not depend on the machine's load.

The claims checked: each compression's accuracy is within :data:`MARGIN` of dense FSDP2's; each
compressed run's link bytes less the reduce-scatter bytes the library counts are the same in every
compressed run (they are the all-gathers and the set-up), within :data:`LINK_TOLERANCE` of the dense
run's link bytes. Dense's link less that rest is what FSDP2's own reduce-scatter put on the link.
Results: ``benchmarks/results/fsdp_digits.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common.limited_link import reproducing_options
from benchmarks.common.report import REPO, RESULTS, load_average, machine
from benchmarks.common.worker_exit import end_worker

#: The compressions run (names of the example's ``--compression``), dense first.
COMPRESSIONS = ("dense", "qsgd", "u8bit", "topk-ef", "legacy-topk-ef")
QUICK_COMPRESSIONS = ("dense", "qsgd")
#: How far below dense FSDP2's test accuracy a compression may end (percentage points, one seed).
MARGIN = 2.0
#: How far the interface's saving may lie from the library's count, as a share of dense's link bytes.
LINK_TOLERANCE = 0.02
HEADER = ("| compression | test accuracy | vs dense (points) | within {margin:g} points | link MB sent | "
          "reduce-scatter MB counted (volume) | rest MB |\n|---|---|---|---|---|---|---|")


def example() -> object:
    """``examples/train_digits_fsdp.py`` as a module (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("train_digits_fsdp", REPO / "examples" / "train_digits_fsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common.link_counters import header_bytes, read_link

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train_digits = example()
    options = train_digits.parse_args(["--compression", args.compression, "--epochs", str(args.epochs)])
    dist.barrier()
    before = read_link()
    result = train_digits.train(options)
    dist.barrier()
    link = (read_link() - before).as_dict(header_bytes())
    result["link"] = link
    Path(args.json).with_name(f"{args.compression}-rank{dist.get_rank()}.json").write_text(json.dumps(result))
    end_worker()  # FSDP2's own Gloo collectives can abort a finalizing interpreter


def launch(args: argparse.Namespace) -> dict:
    from benchmarks.common.netns import Cluster, TorchJob, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"benchmarks.accuracy.fsdp_digits: {reason}")
    runs = {}
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp, Cluster(args.workers) as cluster:
        for compression in args.compressions:
            argv = [sys.executable, "-m", "benchmarks.accuracy.fsdp_digits", "--worker", "--compression",
                    compression, "--epochs", str(args.epochs), "--json", str(Path(tmp) / "out.json")]
            env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            with TorchJob(cluster, argv, Path(tmp) / f"logs-{compression}", env=env, cwd=REPO) as job:
                job.wait(args.timeout)
            runs[compression] = [json.loads((Path(tmp) / f"{compression}-rank{rank}.json").read_text())
                                 for rank in range(args.workers)]
            print(f"{compression}: accuracy {runs[compression][0]['accuracy']:.2%}", flush=True)
    return {"runs": runs, "workers": args.workers, "epochs": args.epochs, "machine": machine(),
            "load_average": [load_before, load_average()]}


def summarise(result: dict) -> dict:
    """Per compression: accuracy, link bytes sent per rank (the ranks' mean), the library's
    reduce-scatter counts, the rest of the link (all-gathers, set-up), memory, and the checks."""
    def mean(ranks: list[dict], *keys: str) -> float:
        values = []
        for r in ranks:
            value = r
            for key in keys:
                value = value[key]
            values.append(value)
        return sum(values) / len(values)

    rows = {}
    for name, ranks in result["runs"].items():
        row = {"accuracy": ranks[0]["accuracy"], "link_bytes": mean(ranks, "link", "tx_payload")}
        if ranks[0]["stats"] is not None:
            row.update(wire_bytes=mean(ranks, "stats", "wire_bytes"), wire_dense=mean(ranks, "stats", "wire_dense"),
                       memory=ranks[0]["memory"])
            row["volume"] = row["wire_bytes"] / row["wire_dense"]
            row["rest"] = row["link_bytes"] - row["wire_bytes"]
        rows[name] = row
    dense = rows["dense"]
    rests = sorted(row["rest"] for row in rows.values() if "rest" in row)
    rest = rests[len(rests) // 2] if rests else 0.0
    for row in rows.values():
        row["within_margin"] = 100 * (dense["accuracy"] - row["accuracy"]) <= MARGIN
        if "rest" in row:
            row["link_agrees"] = abs(row["rest"] - rest) <= LINK_TOLERANCE * dense["link_bytes"]
    dense["rest"] = rest
    dense["reduce_scatter_on_link"] = dense["link_bytes"] - rest
    dense["wire_dense"] = next((row["wire_dense"] for row in rows.values() if "wire_dense" in row), float("nan"))
    return rows


def write(result: dict, results_dir: Path, command: str) -> None:
    rows = summarise(result)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "fsdp_digits.json").write_text(json.dumps({**result, "summary": rows}, indent=1))
    dense = rows["dense"]
    lines, memory_lines = [], []
    for name, row in rows.items():
        delta = 100 * (row["accuracy"] - dense["accuracy"])
        if "wire_bytes" in row:
            counted = (f"{row['wire_bytes'] / 1e6:.3f} of {row['wire_dense'] / 1e6:.3f} ({row['volume']:.2%}) | "
                       f"{row['rest'] / 1e6:.3f} ({'agrees' if row['link_agrees'] else 'DIFFERS'})")
            memory = row["memory"]
            memory_lines.append(f"| {name} | {memory['state'] / 1e3:.1f} | {memory['exchange'] / 1e3:.1f} | "
                                f"{memory['gradient_shard'] / 1e3:.1f} | {memory['unsharded_gradient'] / 1e3:.1f} | "
                                f"{memory['state'] / memory['gradient_shard']:.2f} |")
        else:
            counted = f"{dense['reduce_scatter_on_link'] / 1e6:.3f} on the link | -"
        lines.append(f"| {name} | {row['accuracy']:.2%} | {delta:+.2f} | {'yes' if row['within_margin'] else 'NO'} | "
                     f"{row['link_bytes'] / 1e6:.3f} | {counted} |")
    failed = [name for name, row in rows.items() if not row["within_margin"] or row.get("link_agrees") is False]
    verdict = (f"Every compression ends within {MARGIN:g} points of dense FSDP2's accuracy, and every compressed "
               f"run's link less its counted reduce-scatter is the same within {LINK_TOLERANCE:.0%} of dense's link."
               if not failed else f"Not met by: {', '.join(failed)} (see the table).")
    gloo = dense["reduce_scatter_on_link"] / dense["wire_dense"]
    text = f"""# FSDP2 on digits: accuracy, link bytes and memory per compression

`{command}` (needs root). {result['workers']} workers, {result['epochs']} epochs, one seed; machine:
{result['machine']}, load average {result['load_average'][0]:.1f} before and {result['load_average'][1]:.1f}
after (accuracy and bytes do not depend on it). Each worker in its own network namespace (no rate
limit); *link* is the TCP payload its interface sent during training, the ranks' mean: FSDP2's
parameter all-gathers (dense in every run), the reduce-scatters, the set-up's collectives;
*counted* the reduce-scatter bytes grace_legacy counts per rank, against a bandwidth-optimal dense
reduce-scatter's ((P - 1) padded shards); *rest* the link less the counted reduce-scatter, which
must be the same in every compressed run (the all-gathers and set-up) within {LINK_TOLERANCE:.0%} of dense's
link bytes.

{HEADER.format(margin=MARGIN)}
{chr(10).join(lines)}

{verdict} Dense FSDP2's own reduce-scatter put {dense['reduce_scatter_on_link'] / 1e6:.3f} MB per rank on
the link (dense's link less the compressed runs' median rest): {gloo:.2f} times a bandwidth-optimal
reduce-scatter's {dense['wire_dense'] / 1e6:.3f} MB under Gloo, so against FSDP2 on Gloo the compressed
reduce-scatter saves more than its volume says.

## Memory per rank (rank 0, kB)

*state*: the tensors the memory and compressor keep between steps; *exchange*: the most one unit's
send and receive buffers held at once; FSDP2's own gradient shard and the unsharded gradient.

| compression | state | exchange | gradient shard | unsharded gradient | state / shard |
|---|---|---|---|---|---|
{chr(10).join(memory_lines)}
"""
    (results_dir / "fsdp_digits.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 workers, 1 epoch, dense and QSGD")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--compressions", nargs="+", default=None, choices=COMPRESSIONS)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compression", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.workers = args.workers or (2 if args.quick else 4)
    args.epochs = args.epochs or (1 if args.quick else 20)
    args.compressions = args.compressions or list(QUICK_COMPRESSIONS if args.quick else COMPRESSIONS)
    if "dense" not in args.compressions:
        args.compressions.insert(0, "dense")
    result = launch(args)
    command = " ".join(["python -m benchmarks.accuracy.fsdp_digits", *reproducing_options(sys.argv[1:])])
    write(result, args.results, command)
    print(json.dumps({name: round(row["accuracy"], 4) for name, row in summarise(result).items()}))


if __name__ == "__main__":
    main()
