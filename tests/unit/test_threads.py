"""Every compressor gives the same bits whatever the thread count.

The compiled CPU passes run on ``torch.get_num_threads()`` threads by fixed blocks
(:mod:`grace_legacy.compressors.kernels.compiled`), so a payload, its decompressed tensor and an
aggregate of two payloads must be identical at 1, 3 and 4 threads (one; an odd count, whose
threads get unequal shares of the blocks; the pool's whole). Correctness needs no real cores:
the check runs in a child process whose numba pool has 4 threads (``NUMBA_NUM_THREADS=4``) on any
machine, and also checks that the passes really were launched on that many threads and
that numba's pool really ran them on that many.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grace_legacy.compressors.kernels import compiled
from tests.registry import ENTRIES

REPO = Path(__file__).resolve().parents[2]
THREADS = (1, 3, 4)
#: Odd element counts (a lone last element, a partial last byte) of five blocks, enough to spread
#: over 4 threads once a thread is worth a block (the child sets ``PER_THREAD`` to ``BLOCK``: which
#: thread count a pass picks is not what is checked, and the blocks, which fix the bits, stay);
#: matrices for PowerSGD, a near-square one and a wide one.
SHAPES = [(521, 541), (3, 93_337)]
DTYPES = [torch.float32, torch.float64]


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def digests(threads: int) -> dict[str, str]:
    """Per compressor, shape and dtype: a digest of two steps' payloads and decompressed tensors on
    ranks 0 and 1, and of their aggregate, computed on ``threads`` threads."""
    torch.set_num_threads(threads)
    out = {}
    for entry in ENTRIES:
        for shape in SHAPES:
            for dtype in DTYPES:
                parts = []
                compressors = [entry.typical(), entry.typical()]
                for rank, compressor in enumerate(compressors):
                    compressor.set_rank(rank)
                for step in range(2):
                    payloads, contexts, concrete = [], [], None
                    for rank, compressor in enumerate(compressors):
                        g = torch.Generator().manual_seed(1000 * step + rank)
                        tensor = (torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** (step - 1)).to(dtype)
                        concrete = compressor.compressor_for(tensor, "w")
                        if concrete is None:
                            break
                        payload, ctx = concrete.compress(tensor, "w")
                        for _ in range(concrete.traits.rounds - 1):
                            payload, ctx = concrete.next_round(payload, ctx)
                        parts += [*payload, concrete.decompress(payload, ctx)]
                        payloads.append(payload)
                        contexts.append(ctx)
                    if concrete is not None and concrete.traits.rounds == 1:
                        parts.append(concrete.aggregate(payloads, contexts[0], average=True))
                    for compressor in compressors:
                        compressor.end_step()
                out[f"{entry.name} {shape} {dtype}"] = _digest(parts)
    return out


def child() -> None:
    """Run in the child process: the digests at every thread count, the thread counts the passes
    were launched on, and the distinct numba threads a parallel loop ran on at each count."""
    import numba
    import numpy as np

    launched: list[int] = []
    original = compiled.launched

    def recording(threads):
        launched.append(threads)
        return original(threads)

    compiled.launched = recording

    @numba.njit(parallel=True)
    def thread_ids(n):
        ids = np.empty(n, np.int64)
        for i in numba.prange(n):
            ids[i] = numba.get_thread_id()
        return ids

    compiled.PER_THREAD = compiled.BLOCK
    report = {"pool": compiled.pool_size(), "digests": {}, "launched": {}, "ran_on": {}}
    for threads in THREADS:
        launched.clear()
        report["digests"][threads] = digests(threads)
        report["launched"][threads] = max(launched, default=1)
        with original(threads):
            report["ran_on"][threads] = len(set(thread_ids(4096).tolist()))
    report["layer"] = numba.threading_layer()
    print(json.dumps(report))


@pytest.mark.slow
def test_every_compressor_gives_the_same_bits_at_any_thread_count():
    env = {**os.environ, "NUMBA_NUM_THREADS": str(max(THREADS)), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "4"}
    result = subprocess.run([sys.executable, "-c", "from tests.unit.test_threads import child; child()"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["pool"] == max(THREADS)
    assert report["layer"] == ("omp" if compiled._openmp_loads() else "workqueue")
    for threads in THREADS:
        # The largest tensor gets every thread asked for; one thread launches nothing in parallel.
        assert report["launched"][str(threads)] == threads
        assert report["ran_on"][str(threads)] == threads
    one = report["digests"]["1"]
    assert len(one) == len(DTYPES) * len(SHAPES) * len(ENTRIES)
    for threads in THREADS[1:]:
        differing = sorted(key for key, value in report["digests"][str(threads)].items() if one[key] != value)
        assert not differing, f"at {threads} threads: {differing}"


def test_a_pass_runs_on_the_threads_torch_is_given_at_most_the_pool_and_one_per_share():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert compiled.threads_for(10**8) == 1
        torch.set_num_threads(2)
        assert compiled.threads_for(2 * compiled.PER_THREAD - 1) == 1
        assert compiled.threads_for(2 * compiled.PER_THREAD) == min(2, compiled.pool_size())
        torch.set_num_threads(compiled.pool_size() + 3)
        assert compiled.threads_for(10**9) == compiled.pool_size()
    finally:
        torch.set_num_threads(before)


def test_workers_launched_with_one_omp_thread_run_every_pass_on_one_thread():
    """horovodrun and torchrun workers get OMP_NUM_THREADS=1 (the test launcher sets it too):
    torch then has one thread, and so has every pass, whatever numba's pool holds."""
    code = ("import torch; from grace_legacy.compressors.kernels import compiled; "
            "print(torch.get_num_threads(), compiled.threads_for(10**9))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "4", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1", "1"]


#: A parent that ran a pass on two threads forks; the child runs the same pass.
FORK = """
import hashlib, os, torch
from grace_legacy import QSGD
from grace_legacy.compressors.kernels import compiled
torch.set_num_threads(2)
x = torch.randn(4 * compiled.PER_THREAD, generator=torch.Generator().manual_seed(0))
def digest():
    compressor = QSGD(16)
    payload, ctx = compressor.compress(x, "w")
    return hashlib.sha256(compressor.decompress(payload, ctx).numpy().tobytes()).hexdigest()
parent = digest()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, f"{compiled.threads_for(x.numel())} {digest()}".encode())
    os._exit(0)
os.close(write)
_, status = os.waitpid(pid, 0)
print(compiled.threads_for(x.numel()), parent, os.read(read, 200).decode(), os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_runs_its_passes_on_one_thread_with_the_same_bits():
    """GNU OpenMP, numba's threading layer where it loads, ends a forked child that launches a
    parallel loop after its parent did (as a DataLoader worker forked mid-training might): the
    child's passes run on one thread instead, with the same results."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    parent_threads, parent, child_threads, child, status = result.stdout.split()
    assert (parent_threads, child_threads, status) == ("2", "1", "0")
    assert child == parent
