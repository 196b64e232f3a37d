"""A compiled loop that calls another is found in numba's disk cache by the next process.

numba keys a cached loop on its code and on its pickled closure; a loop's closure holds the loops it
calls, which pickle with their identity. Were that identity random per process (numba's default), no
process would find such a loop in the cache and each would compile it again for each dtype (seconds
per loop). :func:`grace_legacy.compressors.kernels.compiled.loop` names each loop instead; here a
second process must pickle every such closure to the same bytes as this one.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import grace_legacy.compressors.kernels as kernels

REPO = Path(__file__).resolve().parents[2]


def closure_digests() -> dict[str, str]:
    """Per compiled loop with a closure, in every kernel module: a digest of the closure as numba's
    cache key pickles it."""
    from numba.core import serialize

    out = {}
    for module_info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{module_info.name}")
        if not hasattr(module, "_kernels"):
            continue
        for name, loop in _loops(module._kernels(), module_info.name):
            closure = loop.py_func.__closure__
            if closure:
                cells = tuple(cell.cell_contents for cell in closure)
                out[name] = hashlib.sha256(serialize.dumps(cells)).hexdigest()
    return out


def _loops(value, name: str, seen: set[int] | None = None):
    """Every compiled loop reachable from ``value``: through namespaces, and the closures of loops
    and of the Python drivers around them."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, SimpleNamespace):
        for key, item in sorted(vars(value).items()):
            yield from _loops(item, f"{name}.{key}", seen)
        return
    function = getattr(value, "py_func", value)
    if hasattr(value, "py_func"):
        yield name, value
    for cell in getattr(function, "__closure__", None) or ():
        inner = cell.cell_contents
        yield from _loops(inner, f"{name}>{getattr(inner, '__name__', '?')}", seen)


def test_loops_that_call_loops_have_the_same_cache_key_in_every_process():
    mine = closure_digests()
    # PowerSGD's passes call their row loops; the stochastic ones, inlined helpers.
    assert any(name.startswith("products.") for name in mine) and any(name.startswith("stochastic.") for name in mine)
    code = ("import json; from tests.unit.test_compiled import closure_digests; "
            "print(json.dumps(closure_digests()))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    assert theirs == mine
