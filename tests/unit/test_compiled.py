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
import pytest
import torch
from numba.core.dispatcher import Dispatcher

from grace_legacy.compressors import kernels
from grace_legacy.compressors.kernels import compiled, warm

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


def child() -> None:
    """Run in a fresh process: what was compiled by the import, then the cache misses of every pass."""
    at_import = sorted(name for name, loop in compiled_loops().items() if loop.overloads)
    warm.every_pass()
    loops = compiled_loops()
    print(json.dumps({"compiled at import": at_import,
                      "used": sorted(name for name, loop in loops.items() if loop.overloads),
                      "missed": sorted(name for name, loop in loops.items() if sum(loop.stats.cache_misses.values()))}))


def test_a_second_process_loads_every_loop_from_the_cache_and_the_import_compiles_none():
    warm.every_pass()  # compiled here, or loaded: either way in the cache from now on
    env = {**os.environ, "PYTHONPATH": str(REPO), "NUMBA_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, "-c", "from tests.unit.test_compiled import child; child()"],
                            capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["compiled at import"] == []
    # Every module's loops ran, the parallel ones too, and none compiled again.
    assert {name.split(".")[0] for name in report["used"]} >= {
        "qsgd_passes", "terngrad_passes", "natural_passes", "sign_passes", "scatter", "selection",
        "threshold_passes", "products", "accumulating"}
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


def test_warming_refuses_a_dtype_the_loops_do_not_take():
    with pytest.raises(SystemExit, match="dtypes must be among .*'float16'"):
        warm.main(["float32", "float16"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.uint16])
def test_outputs_come_from_torchs_allocator_in_the_dtype_asked(dtype):
    # numpy advises huge pages for large arrays; torch's allocator does not (compiled.empty).
    out = compiled.empty(1 << 21, dtype)
    assert out.dtype == dtype and out.shape == (1 << 21,) and isinstance(out.base, torch.Tensor)
    source = np.arange(5).astype(dtype)
    copied = compiled.copy(source[1:4])
    assert np.array_equal(copied, source[1:4]) and isinstance(copied.base, torch.Tensor)
    assert not np.shares_memory(copied, source)
