"""Writing benchmark results: each benchmark owns one marked section of a Markdown file, so
benchmarks can be re-run one at a time without overwriting each other's results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
REPO = RESULTS.parents[1]


def run_workers(module: str, workers: int, *args: str, env: dict[str, str | None] | None = None) -> Any:
    """What rank 0 of ``python -m MODULE --worker --json OUT ARGS``, launched on this host by
    ``horovodrun -np WORKERS --gloo``, wrote to OUT (as JSON). Each worker gets one OpenMP thread
    and ``env`` added to its environment (a ``None`` value removes the variable)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "workers.json"
        cmd = [str(Path(sys.executable).with_name("horovodrun")), "-np", str(workers), "-H", f"localhost:{workers}",
               "--gloo", sys.executable, "-m", module, "--worker", "--json", str(out), *args]
        merged = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        subprocess.run(cmd, check=True, cwd=REPO, env={k: v for k, v in merged.items() if v is not None})
        return json.loads(out.read_text())


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of a benchmark that launches its own ``horovodrun`` workers: ``--quick`` and
    ``--results``, and the hidden ones it passes its workers (``--worker``, ``--json``)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser


@dataclass(frozen=True)
class Repeats:
    """How many timed repetitions (``option``, e.g. ``--steps``) and warm-up ones a benchmark runs:
    ``full`` and ``warmup`` by default, ``quick`` and at most ``quick_warmup`` under ``--quick``."""

    option: str
    full: int
    quick: int
    warmup: int
    quick_warmup: int | None = 1


def benchmark_main(module: str, doc: str | None, repeats: Repeats, *, worker: Callable[[argparse.Namespace], None],
                   launch: Callable[[argparse.Namespace], dict], write: Callable[[dict, Path, str], None],
                   shown: Callable[[dict], Any], options: Callable[[argparse.ArgumentParser], None] | None = None,
                   ) -> None:
    """The ``main()`` of a benchmark that launches its own workers: parse the options (the shared
    ones, ``repeats``' and those ``options`` adds), run as a worker when launched as one, else
    launch the workers, write the report under the command that reproduces it and print
    ``shown(result)``."""
    parser = benchmark_parser(doc)
    parser.add_argument(repeats.option, type=int, default=None, help="timed repetitions per way")
    parser.add_argument("--warmup", type=int, default=repeats.warmup)
    if options is not None:
        options(parser)
    args = parser.parse_args()
    attribute = repeats.option.lstrip("-").replace("-", "_")
    if getattr(args, attribute) is None:
        setattr(args, attribute, repeats.quick if args.quick else repeats.full)
    if args.quick and repeats.quick_warmup is not None:
        args.warmup = min(args.warmup, repeats.quick_warmup)
    if args.worker:
        worker(args)
        return
    result = launch(args)
    write(result, args.results, f"python -m {module}" + (" --quick" if args.quick else ""))
    print(json.dumps(shown(result), indent=1))


def parse_study_arguments(doc: str | None, seeds: int, quick_seeds: int, partial: str,
                          options: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The options of a long accuracy study that saves its runs as they finish: the shared ones,
    ``--seeds`` (``seeds``, ``quick_seeds`` with ``--quick``), ``--from-partial`` (write the report
    from what a stopped launch saved under ``RESULTS/PARTIAL``) and those ``options`` adds."""
    parser = benchmark_parser(doc)
    parser.add_argument("--seeds", type=int, default=None, help=f"default {seeds} ({quick_seeds} with --quick)")
    parser.add_argument("--from-partial", action="store_true",
                        help=f"only write the report, from the runs saved in RESULTS/{partial} by a stopped launch")
    parser.add_argument("--partial", help=argparse.SUPPRESS)
    if options is not None:
        options(parser)
    args = parser.parse_args()
    if args.seeds is None:
        args.seeds = quick_seeds if args.quick else seeds
    return args


def write_report(results_dir: Path, name: str, result: dict, section: str) -> None:
    """Write ``result`` to ``NAME.json`` and ``section`` to the section ``NAME`` of ``performance.md``."""
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    update_section(results_dir / "performance.md", name, section, title="Performance results")


def machine() -> str:
    """A one-line description of where the numbers were measured."""
    model = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                      if line.startswith("Model name")), model)
    except (OSError, subprocess.CalledProcessError):
        pass
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}, "
            f"{datetime.date.today().isoformat()}")


def code_version() -> str:
    """The commit the measured code is at (``-dirty`` appended when a tracked file outside
    ``benchmarks/results``, which the benchmarks themselves write, differs from it), or
    ``"unknown"`` outside a git checkout: which code a run timed, for reports made over several
    sessions."""
    def git(*arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *arguments], cwd=REPO, capture_output=True, text=True)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return "unknown"
        changed = git("diff", "--quiet", "HEAD", "--", ".", ":(exclude)benchmarks/results").returncode
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if changed else "")


def load_average() -> float:
    """The 1-minute load average: how busy the machine is (other jobs make timings noisy)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def load_note(before_after: list[float]) -> str:
    before, after = before_after
    return f"load average {before:.1f} before and {after:.1f} after the run"


def update_section(path: Path, key: str, markdown: str, title: str | None = None) -> None:
    """Replace (or append) the section between ``<!-- begin KEY -->`` and ``<!-- end KEY -->``."""
    begin, end = f"<!-- begin {key} -->", f"<!-- end {key} -->"
    text = path.read_text() if path.exists() else (f"# {title}\n" if title else "")
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def median_interval(samples: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap confidence interval (percentile method) of the median of ``samples``."""
    values = np.asarray(samples)
    draws = np.random.default_rng(seed).integers(0, values.size, (resamples, values.size))
    medians = np.median(values[draws], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))
