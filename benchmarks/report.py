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
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
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
