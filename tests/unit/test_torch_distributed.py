"""What ``TorchDistributedBackend`` hands torch.distributed: nothing a Gloo worker thread would have
to release with the GIL (see :mod:`grace_legacy.backends.torch_distributed`, and
``tests/distributed/test_clean_exit.py`` for the jobs that exited with an abort before).

In a one-rank Gloo group, through real DDP steps with the hook (where ``torch.autograd.backward``
has a ``contextvars.Context`` in thread-local state) and through each collective outside it: every
collective is issued with no such context in thread-local state, and once the steps are over no
tensor handed to a collective is kept alive by its work alone (the module holds them until no work
does, and lets them go at a later collective). Both fail on the code before the fix, whatever the
timing. In a subprocess, so that no process group outlives it in this test process.
"""

import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import gc
import time
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from grace_legacy import Legacy, TopK
from grace_legacy.backends import torch_distributed as td

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
issued, works, handed = [], [], []


def recording(name, real):
    def collective(*args, **kwargs):
        issued.append((name, torch._C._is_key_in_tls("context")))
        handed.extend(weakref.ref(a) for a in args if isinstance(a, torch.Tensor))
        work = real(*args, **kwargs)
        works.append(work)
        return work
    return collective


dist.all_reduce = recording("all_reduce", dist.all_reduce)
dist.broadcast = recording("broadcast", dist.broadcast)
td._gather_into_tensor = recording("allgather", td._gather_into_tensor)
dist.all_to_all_single = recording("alltoall", dist.all_to_all_single)

in_backward = []
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))
model[0].weight.register_hook(lambda g: in_backward.append(torch._C._is_key_in_tls("context")))
ddp = DistributedDataParallel(model)
grace_legacy.ddp.register(ddp, Legacy(TopK(), by="layer", values=[1.0, 0.1], splits=[100]))
for _ in range(2):
    ddp(torch.randn(4, 30)).sum().backward()
assert in_backward == [True, True], ("this torch keeps no context in a backward pass", in_backward)
in_hook = len(issued)

backend = td.TorchDistributedBackend()
x = torch.arange(6.0).reshape(3, 2)
assert torch.equal(backend.wait(backend.allreduce_async(x, "sum", average=False)), x)
assert torch.equal(backend.wait(backend.broadcast_async(x, 0, "bcast")), x)
assert torch.equal(backend.wait(backend.allgather_async(x, "gather")), x)
backend.variable_gather = "exact"
assert torch.equal(backend.wait(backend.allgather_async(x, "gather exact")), x)
assert torch.equal(backend.wait(backend.alltoall_async(x, [3], "shards")), x)
names = {{name for name, _ in issued}}
assert names == {{"all_reduce", "broadcast", "allgather", "alltoall"}}, names
captured = [entry for entry in issued if entry[1]]
assert not captured, ("issued with the backward pass's context in thread-local state", captured)

# Every step is over and its results dropped. A tensor whose Python object only its work still
# kept alive would now die with the work: on whichever thread lets go of the work last, which may
# be a Gloo worker, at exit. None may.
n = len(handed)
del works[:]
gc.collect()
deadline = time.monotonic() + 1.0
while time.monotonic() < deadline:
    died = [i for i, ref in enumerate(handed) if ref() is None]
    assert not died, (f"{{len(died)}} of {{n}} tensors handed to collectives lived only in their work", died[:5])
    time.sleep(0.05)

# Once no work holds them, the next collective lets every earlier one go.
deadline = time.monotonic() + 60
while any(ref() is not None for ref in handed[:n]):
    assert time.monotonic() < deadline, "tensors handed to collectives are still kept a minute later"
    backend.wait(backend.allreduce_async(x, "next", average=False))
    time.sleep(0.01)
print("ok", in_hook, n)
"""


def test_collectives_are_issued_with_no_python_left_to_their_workers(tmp_path):
    script = tmp_path / "lent.py"
    script.write_text(SCRIPT.format(port=free_port()))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                            cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout
    hook_collectives = int(result.stdout.split()[1])
    assert hook_collectives > 2, result.stdout  # the hook's own, besides registration's digest
