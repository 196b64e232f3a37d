"""How the compiled loops are made (``grace_legacy/compressors/kernels/compiled.py``): importing the
package compiles none; a loop compiled in one process is loaded from numba's disk cache by the next
(every horovodrun worker would otherwise compile what it uses again), its parallel variant too;
and where numba finds no folder to cache in, the loops compile uncached rather than fail.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import torch
from numba.core.dispatcher import Dispatcher

from grace_legacy.compressors import kernels
from grace_legacy.compressors.kernels import (
    compiled,
    natural_passes,
    products,
    qsgd_passes,
    scatter,
    selection,
    sign_passes,
    terngrad_passes,
    threshold_passes,
)

REPO = Path(__file__).resolve().parents[2]


def compiled_loops() -> dict[str, Dispatcher]:
    """Every compiled loop of the kernels package, by ``module.name``."""
    loops = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, Dispatcher) and value.py_func.__module__ == module.__name__:
                loops[f"{info.name}.{name}"] = value
    return loops


def every_pass() -> None:
    """Each module's passes once, serial (one thread) and parallel (two), on float32."""
    x = torch.randn(selection.SMALL + 1001, generator=torch.Generator().manual_seed(0))
    matrix = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    before = (torch.get_num_threads(), compiled.PER_THREAD)
    compiled.PER_THREAD = 1
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            norm = qsgd_passes.norm(x)
            levels = qsgd_passes.levels(x, norm, 16, 7, torch.int8)
            qsgd_passes.decoded(levels, torch.tensor([norm]), 16, torch.float32)
            terngrad_passes.spread(x)
            terngrad_passes.digits(x, 2.0, 2.0, 7)
            top, codes = natural_passes.codes(x, 7)
            natural_passes.decoded(top, codes, torch.float32, torch.float32)
            sign_passes.side_means(x)
            sign_passes.mean_magnitude(x)
            buffer, packed = sign_passes.momentum_step(x, x, 0.9)
            sign_passes.choose(packed, x.numel(), torch.tensor(1.0), torch.tensor(-1.0))
            scatter.put(torch.zeros(x.numel()), torch.arange(0, x.numel(), 3, dtype=torch.int32), x[::3].clone())
            selection.top_k_indices(x, 100)
            threshold_passes.entries_at_or_above(x, 2.0, torch.int32)
            q = products.matrix_times(matrix, torch.randn(200, 4))
            products.times_transposed(q, products.transposed_times(q, matrix).t())
    finally:
        torch.set_num_threads(before[0])
        compiled.PER_THREAD = before[1]


def child() -> None:
    """Run in a fresh process: what was compiled by the import, then the cache misses of every pass."""
    at_import = sorted(name for name, loop in compiled_loops().items() if loop.overloads)
    every_pass()
    loops = compiled_loops()
    print(json.dumps({"compiled at import": at_import,
                      "used": sorted(name for name, loop in loops.items() if loop.overloads),
                      "missed": sorted(name for name, loop in loops.items() if sum(loop.stats.cache_misses.values()))}))


def test_a_second_process_loads_every_loop_from_the_cache_and_the_import_compiles_none():
    every_pass()  # compiled here, or loaded: either way in the cache from now on
    env = {**os.environ, "PYTHONPATH": str(REPO), "NUMBA_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-c", "from tests.unit.test_compiled import child; child()"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["compiled at import"] == []
    # Every module's loops ran, the parallel ones too, and none compiled again.
    assert {name.split(".")[0] for name in report["used"]} >= {
        "qsgd_passes", "terngrad_passes", "natural_passes", "sign_passes", "scatter", "selection",
        "threshold_passes", "products"}
    assert sum(name.endswith("_parallel") for name in report["used"]) >= 10
    assert report["missed"] == []


def test_without_a_folder_to_cache_in_a_loop_compiles_uncached(monkeypatch):
    # The zip locator alone finds no place for a module that is not in a zip file: numba then
    # refuses cache=True, as it does for a read-only install with a read-only home.
    monkeypatch.setattr(numba.config, "CACHE_LOCATOR_CLASSES", "ZipCacheLocator")

    def twice(x):  # pragma: no cover - compiled
        return 2 * x

    loop = compiled.loop(twice)
    assert type(loop._cache).__name__ == "NullCache"
    assert np.array_equal(loop(np.arange(3.0)), [0.0, 2.0, 4.0])
