"""What ``HorovodBackend`` hands Horovod, in a one-process Horovod (in a subprocess, so that no
Horovod outlives it here): every tensor of a collective, the input and the outputs Horovod's
wrapper made, is held from C++ besides its Python object while the collective is in flight, so
Horovod's background thread never lets go of the last such reference (which needs the GIL, and
deadlocked a job whose rank launched a collective while Horovod shut down:
docs/DESIGN.md#clean-exit); a later launch lets go of them once Horovod has. And a launch's
handle carries what its wait needs, so a table by handle number (which Horovod restarts after an
elastic reset) is never consulted."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("horovod.torch")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import time

import horovod.torch as hvd
import horovod.torch.mpi_ops as mpi_ops
import torch

from grace_legacy.backends.horovod import HorovodBackend, Launched

hvd.init()
backend = HorovodBackend()
x = torch.arange(6.0).reshape(3, 2)
launches = {
    "allreduce": lambda: backend.allreduce_async(x.clone(), "sum", average=False),
    "allgather": lambda: backend.allgather_async(x.clone(), "gather"),
    "broadcast": lambda: backend.broadcast_async(x.clone(), 0, "bcast"),
    "alltoall": lambda: backend.alltoall_async(x.clone(), [3], "shards"),
}
lent = []
for name, launch in launches.items():
    launched = launch()
    assert isinstance(launched, Launched) and launched.name, name
    entry = mpi_ops._handle_map[launched.handle]
    tensors = [t for part in entry for t in (part if isinstance(part, tuple) else (part,))
               if isinstance(t, torch.Tensor)]
    assert len(tensors) >= 2, (name, entry)
    assert torch.equal(backend.wait(launched), x), name
    # Done, and Horovod has let go (one process: at once); nothing launched since, so ours still hold.
    time.sleep(0.2)
    counts = [t._use_count() for t in tensors]
    assert min(counts) >= 2, (name, "not held from C++ besides its Python object", counts)
    lent += tensors
del entry, tensors
# Horovod lets go of a finished collective's tensors soon after its wait; a later launch then lets
# go of ours.
deadline = time.monotonic() + 60
while any(t._use_count() > 1 for t in lent):
    assert time.monotonic() < deadline, ("still held a minute later", [t._use_count() for t in lent])
    backend.wait(backend.allreduce_async(x.clone(), "later", average=False))
    time.sleep(0.01)
print("ok")
"""


def test_every_tensor_horovod_is_handed_is_held_from_cpp_until_horovod_lets_go(tmp_path):
    script = tmp_path / "lent.py"
    script.write_text(SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=REPO,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
