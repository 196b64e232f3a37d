"""The one switch that sends CPU tensors down the path a GPU's take (:mod:`grace_legacy.runtime.paths`).

* every choice of a path in the package goes through ``paths.cpu_path``: no other test of a
  tensor's device is left, apart from the two that are facts about the device (where NCCL can move
  a tensor, which devices a DDP future waits on);
* ``GRACE_LEGACY_DEVICE_PATH=1`` sets it for a process, and a bad value is refused;
* along the device path no compiled loop, no numpy view and no kept buffer is used, for every
  compressor, memory and communicator of the zoo: what a GPU would run (the zoo's exactness along
  that path is ``tests/unit/test_zoo_in_process.py``); and, in the same pass, no tensor is made
  without a device, except where the code means the host (CPU generators, whose draws are then
  moved; a threshold rounded on the host): a tensor made on the CPU and used with a GPU's would
  fail only on a GPU.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from numba.core.dispatcher import Dispatcher
from torch.overrides import TorchFunctionMode

from grace_legacy.compressors import kernels
from grace_legacy.compressors.kernels import compiled
from grace_legacy.runtime import buffers, paths
from tests import zoo_in_process as zoo
from tests.helpers import ThreadBackend, World
from tests.registry import ENTRIES, zoo_cases

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "grace_legacy"

#: Tests of a tensor's device that are facts about the device, not a choice of path: file -> why.
DEVICE_FACTS = {
    "runtime/paths.py": "the switch itself",
    "ddp.py": "a DDP future waits on the CUDA device its buffer is on",
    "backends/torch_distributed.py": "NCCL moves CUDA tensors only, so CPU tensors are staged there",
    "fsdp/__init__.py": "FSDP's non-finite flags are set on its reduce-scatter's CUDA stream, waited for before read",
    "communicators/fusion.py": "a step's flat is named after its device (a CPU flat keeps the plain name)",
}


def test_every_choice_of_path_goes_through_the_switch():
    pattern = re.compile(r"device\.type\s*[!=]=|\.is_cuda\b|\.is_cpu\b")
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        hits = [number for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
        if hits:
            found[relative] = hits
    assert set(found) <= set(DEVICE_FACTS), {name: lines for name, lines in found.items() if name not in DEVICE_FACTS}
    assert "runtime/paths.py" in found  # the pattern does find the switch's own test


def test_the_switch_is_scoped_and_restores_what_was_before():
    x = torch.zeros(3)
    before = paths.FORCE_DEVICE_PATH
    with paths.device_path(True):
        assert not paths.cpu_path(x) and not compiled.applies(x)
        with paths.device_path(False):
            assert paths.cpu_path(x)
        assert not paths.cpu_path(x)
    assert paths.FORCE_DEVICE_PATH == before
    with pytest.raises(RuntimeError), paths.device_path(True):
        raise RuntimeError("inside")
    assert paths.FORCE_DEVICE_PATH == before


@pytest.mark.parametrize(("value", "forced"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_environment_variable_sets_the_path_of_a_process(value, forced):
    code = ("import torch; from grace_legacy.runtime import paths; "
            "from grace_legacy.compressors.kernels import compiled; "
            "print(paths.FORCE_DEVICE_PATH, compiled.applies(torch.zeros(2)))")
    env = {**os.environ, paths.ENVIRONMENT: value, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(forced), str(not forced)]


def test_a_bad_value_of_the_environment_variable_is_refused():
    env = {**os.environ, paths.ENVIRONMENT: "gpu", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", "import grace_legacy"], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=300)
    assert result.returncode != 0 and "GRACE_LEGACY_DEVICE_PATH must be one of" in result.stderr


def _forbid(*_, **__):
    raise AssertionError("a CPU-only path was taken along the device path")


@pytest.fixture
def cpu_only_paths_forbidden(monkeypatch):
    """The device path on, and every CPU-only path made to fail if it is taken."""
    forbidden = 0
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, value in list(vars(module).items()):
            if isinstance(value, Dispatcher):  # a compiled loop
                monkeypatch.setattr(module, name, _forbid)
                forbidden += 1
    assert forbidden, "no compiled loop found to forbid: the fixture would watch nothing"
    monkeypatch.setattr(compiled, "run", _forbid)
    monkeypatch.setattr(compiled, "launched", _forbid)
    monkeypatch.setattr(np, "packbits", _forbid)
    monkeypatch.setattr(np, "unpackbits", _forbid)
    monkeypatch.setattr(buffers, "zeroed", _forbid)  # a kept buffer handed out again
    with paths.device_path(True):
        yield


@pytest.mark.slow
@pytest.mark.parametrize("case", zoo_cases(), ids=[case.label for case in zoo_cases()])
def test_the_device_path_takes_no_cpu_only_path_and_makes_every_tensor_on_the_device(case,
                                                                                   cpu_only_paths_forbidden):
    """Each zoo case (every compressor, memory and communicator) along the device path, one rank:
    no CPU-only path taken, and no tensor made without a device but the known host ones."""
    watch = DevicelessFactories()
    with watch:
        report = zoo._rank(case, ThreadBackend(World(1), 0), torch.device("cpu"), 2, list(zoo.TENSORS))
    assert not report.failures, report.failures[:5]
    unexpected = {where: count for where, count in watch.seen.items() if where not in HOST_TENSORS}
    assert not unexpected, f"tensors made without a device (they would land on the CPU beside a GPU's): {unexpected}"


@pytest.mark.parametrize("entry", ENTRIES, ids=[entry.name for entry in ENTRIES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_every_compressor_on_the_device_path_takes_no_cpu_only_path(entry, dtype, cpu_only_paths_forbidden):
    tensors = [torch.randn(700, 1000, generator=torch.Generator().manual_seed(rank)).to(dtype) for rank in range(2)]
    payloads, contexts = [], []
    for rank, tensor in enumerate(tensors):
        compressor = entry.typical()
        compressor.set_rank(rank)
        concrete = compressor.compressor_for(tensor, "w")
        payload, ctx = concrete.compress(tensor, "w")
        for _ in range(concrete.traits.rounds - 1):
            payload, ctx = concrete.next_round(payload, ctx)
        concrete.decompress(payload, ctx)
        payloads.append(payload)
        contexts.append(ctx)
    if concrete.traits.rounds == 1:
        concrete.aggregate(payloads, contexts[0], average=True)


#: Tensors made without a device on purpose: (file, function) -> why.
HOST_TENSORS = {
    ("compressors/dgc.py", "sample_indices"): "DGC's sample, from a CPU generator: the same positions on every device",
    ("compressors/randomk.py", "uniform_subset"): "Random-k's indices, from a CPU generator, moved to the device",
    ("compressors/powersgd.py", "_start_q"): "PowerSGD's first Q, from a CPU generator, moved to the device",
    ("compressors/kernels/threshold_passes.py", "magnitude_bound"):
        "a threshold rounded on the host, moved where compared",
    ("compressors/adaq.py", "threshold"): "AdaQ's sample, from a CPU generator: the same positions on every device",
}
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.randn, torch.rand,
             torch.randint, torch.randperm, torch.eye, torch.as_tensor, torch.linspace, torch.frombuffer}


class DevicelessFactories(TorchFunctionMode):
    """Records every tensor factory called from grace_legacy without ``device=``, by (file, function)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple[str, str], int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            # The caller is the innermost frame outside torch; only grace_legacy's own calls count (a
            # test's reference compressor, called from a memory, is not the package's). Frames are
            # walked, not extracted: extracting reads every frame's source line, at every factory call.
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            filename = frame.f_code.co_filename if frame is not None else ""
            if f"{os.sep}grace_legacy{os.sep}" in filename:
                where = (filename.split(f"grace_legacy{os.sep}")[-1].replace(os.sep, "/"), frame.f_code.co_name)
                self.seen[where] = self.seen.get(where, 0) + 1
        return func(*args, **kwargs)


def test_the_watch_sees_the_host_tensors_it_knows_of():
    """The factory watch of the zoo test above sees a tensor the package makes on the host on
    purpose (Random-k's indices), so an empty record there means none was made, not a blind watch."""
    watch = DevicelessFactories()
    case = next(case for case in zoo_cases() if "RandomK" in case.label)
    with paths.device_path(True), watch:
        zoo._rank(case, ThreadBackend(World(1), 0), torch.device("cpu"), 1, ["fc1.weight"])
    assert ("compressors/randomk.py", "uniform_subset") in watch.seen, watch.seen
