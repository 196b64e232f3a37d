"""What ``TorchDistributedBackend`` hands torch.distributed: nothing a Gloo worker thread would have
to release with the GIL (docs/DESIGN.md#clean-exit; ``tests/distributed/test_clean_exit.py`` runs
the jobs that could abort at exit).

In a one-rank Gloo group, through real DDP steps with the hook (where ``torch.autograd.backward``
has a ``contextvars.Context`` in thread-local state) and through each collective outside it: every
collective is issued with no such context in thread-local state, and every tensor handed to one is
held from C++ besides its Python object (so the work's release of it is never the one that
decrements the Python object); once the works are done with them, a later collective lets go of
them. Both fail on the code before the fix, whatever the timing. In a subprocess, so that no process
group outlives it in this test process.
"""

import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import grace_legacy.ddp
from grace_legacy import Legacy, TopK
from grace_legacy.backends import torch_distributed as td

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
issued, handed = [], []


def recording(name, real):
    def collective(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        issued.append((name, torch._C._is_key_in_tls("context"), [t._use_count() for t in tensors]))
        handed.extend((t, t._use_count()) for t in tensors)
        return real(*args, **kwargs)
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
names = {{name for name, _, _ in issued}}
assert names == {{"all_reduce", "broadcast", "allgather", "alltoall"}}, names
captured = [entry for entry in issued if entry[1]]
assert not captured, ("issued with the backward pass's context in thread-local state", captured)
# A count of 1 is the Python object's own reference: the work's release would then be the one
# that decrements the Python object, which needs the GIL.
unheld = [entry for entry in issued if min(entry[2], default=2) < 2]
assert not unheld, ("a tensor handed over with no C++ reference besides its Python object", unheld)

# Once no work holds them, a later collective lets go of every earlier one.
n = len(handed)
deadline = time.monotonic() + 60
while any(t._use_count() >= count for t, count in handed[:n]):
    assert time.monotonic() < deadline, "tensors handed to collectives are still held a minute later"
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
