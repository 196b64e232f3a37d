"""Rows of different counts through ``torch.distributed``: padded to the longest vs sent exactly.

    python -m benchmarks.performance.variable_gather            # 4 torchrun workers, Gloo
    python -m benchmarks.performance.variable_gather --quick    # a smoke run

``TorchDistributedBackend`` gathers payloads whose size differs between ranks (Threshold's, empty
ones) in two steps: the row counts, then the rows. The rows either travel padded to the longest
rank's count in one allgather (``variable_gather="padded"``), or exactly, each rank broadcasting
its own (``"exact"``: one collective per rank, fewer bytes when counts differ); ``"auto"``, the
default, picks one per gather from the counts. This benchmark times the three, interleaved, from
``allgather_async`` to the gathered tensor, on uint8 buffers as the bundle hands them over, for
equal sizes (Top-k) and for the spreads Threshold produces. Results go to
``benchmarks/results/variable_gather.md`` and ``.json``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common.report import (
    REPO,
    benchmark_parser,
    load_average,
    load_note,
    machine,
    median_interval,
    update_section,
)
from grace_legacy.backends.torch_distributed import VARIABLE_GATHERS, TorchDistributedBackend

WORKERS = 4
KIB = 1024

#: label -> bytes each rank sends, by rank (4 ranks).
SCENARIOS = {
    "equal, 64 KiB each": [64 * KIB] * 4,
    "equal, 4 MiB each": [4096 * KIB] * 4,
    "spread, 0.25-1 MiB": [256 * KIB, 512 * KIB, 768 * KIB, 1024 * KIB],
    "one 4 MiB, three 16 KiB": [4096 * KIB, 16 * KIB, 16 * KIB, 16 * KIB],
    "two empty, two 1 MiB": [0, 0, 1024 * KIB, 1024 * KIB],
}


def worker(repeats: int) -> dict:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    backends = {mode: TorchDistributedBackend(variable_gather=mode) for mode in VARIABLE_GATHERS}
    results: dict[str, dict[str, list[float]]] = {}
    for label, sizes in SCENARIOS.items():
        local = torch.full((sizes[rank],), rank, dtype=torch.uint8)
        times: dict[str, list[float]] = {mode: [] for mode in VARIABLE_GATHERS}
        for repeat in range(repeats + 1):
            for mode in VARIABLE_GATHERS if repeat % 2 == 0 else tuple(reversed(VARIABLE_GATHERS)):
                backend = backends[mode]
                dist.barrier()
                started = time.perf_counter()
                gathered = backend.wait(backend.allgather_async(local, label))
                elapsed = time.perf_counter() - started
                assert gathered.numel() == sum(sizes)
                if repeat:  # the first round warms every arm up
                    times[mode].append(elapsed)
        # The slowest rank decides when a gather is over.
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, times)
        results[label] = {mode: np.max([r[mode] for r in per_rank], axis=0).tolist() for mode in VARIABLE_GATHERS}
    dist.destroy_process_group()
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "workers.json"
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(WORKERS),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "benchmarks.performance.variable_gather", "--worker", "--json", str(out),
               "--repeats", str(repeats)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, cwd=REPO, env=env, timeout=1800)
        return json.loads(out.read_text())


def report(results: dict, repeats: int, load: list[float]) -> str:
    lines = [f"## Rows of different counts: padded vs exact vs auto ({WORKERS} torchrun workers, Gloo, loopback)", "",
             f"{machine()}; {load_note(load)}. {repeats} interleaved repeats per arm; a gather's time is the "
             f"slowest rank's, from `allgather_async` to the gathered tensor (the count exchange included). "
             f"Median ms (95% interval of the median).", "",
             f"| payloads | {' | '.join(VARIABLE_GATHERS)} | exact / padded |",
             "|---|" + "---|" * (len(VARIABLE_GATHERS) + 1)]
    for label, times in results.items():
        cells = []
        for mode in VARIABLE_GATHERS:
            low, high = median_interval(times[mode])
            cells.append(f"{1e3 * float(np.median(times[mode])):.2f} ({1e3 * low:.2f}-{1e3 * high:.2f})")
        ratio = float(np.median(times["exact"])) / float(np.median(times["padded"]))
        lines.append(f"| {label} | {' | '.join(cells)} | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (4 if args.quick else 40)
    if args.worker:
        results = worker(repeats)
        if int(os.environ["RANK"]) == 0:
            Path(args.json).write_text(json.dumps(results))
        return
    load = [load_average()]
    results = launch(repeats)
    load.append(load_average())
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "variable_gather.json").write_text(json.dumps({"repeats": repeats, "times_s": results}, indent=1))
    update_section(args.results / "variable_gather.md", "variable-gather", report(results, repeats, load),
                   title="torch.distributed backend: gathering payloads of different sizes")
    print((args.results / "variable_gather.md").read_text())


if __name__ == "__main__":
    main()
