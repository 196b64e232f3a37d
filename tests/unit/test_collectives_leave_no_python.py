"""What ``TorchDistributedBackend`` hands torch.distributed: nothing a Gloo worker thread would have
to release with the GIL (see :mod:`grace_legacy.backends.torch_distributed`, and
``tests/distributed/test_clean_exit.py`` for the jobs that exited with an abort before).

In a one-rank Gloo group, through a real DDP step with the hook (where ``torch.autograd.backward``
has a ``contextvars.Context`` in thread-local state) and through each collective outside it: every
collective is issued with no such context in thread-local state, on tensors whose Python objects
the module holds (not the caller's); once the works are done with them they are given back at the
next collective. In a subprocess, so that no process group outlives it in this test process.
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
issued = []


def recording(name, real):
    def collective(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        lent = all(any(t is alias for entry in td._LENT for alias in entry) for t in tensors)
        issued.append((name, torch._C._is_key_in_tls("context"), lent, len(tensors)))
        return real(*args, **kwargs)
    return collective


dist.all_reduce = recording("all_reduce", dist.all_reduce)
dist.broadcast = recording("broadcast", dist.broadcast)
td._gather_into_tensor = recording("allgather", td._gather_into_tensor)

in_backward = []
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))
model[0].weight.register_hook(lambda g: in_backward.append(torch._C._is_key_in_tls("context")))
ddp = DistributedDataParallel(model)
grace_legacy.ddp.register(ddp, Legacy(TopK(), by="layer", values=[1.0, 0.1], splits=[100]))
for _ in range(2):
    ddp(torch.randn(4, 30)).sum().backward()
assert in_backward == [True, True], ("the backward pass holds no context here", in_backward)
in_hook = len(issued)

backend = td.TorchDistributedBackend()
x = torch.arange(6.0).reshape(3, 2)
assert torch.equal(backend.wait(backend.allreduce_async(x, "sum", average=False)), x)
assert torch.equal(backend.wait(backend.broadcast_async(x, 0, "bcast")), x)
assert torch.equal(backend.wait(backend.allgather_async(x, "gather")), x)
backend.variable_gather = "exact"
assert torch.equal(backend.wait(backend.allgather_async(x, "gather exact")), x)
names = {{name for name, *_ in issued}}
assert names == {{"all_reduce", "broadcast", "allgather"}}, names
bad = [entry for entry in issued if entry[1] or not entry[2] or entry[3] == 0]
assert not bad, ("issued with a context in thread-local state, or on the caller's tensors", bad)

# Once the works are done with them, the next collective gives every earlier alias back.
deadline = time.monotonic() + 60
while any(alias._use_count() > 1 for entry in td._LENT for alias in entry):
    assert time.monotonic() < deadline, "a work still holds its tensors a minute after completing"
    time.sleep(0.01)
backend.wait(backend.allreduce_async(x, "last", average=False))
assert len(td._LENT) == 1, len(td._LENT)
print("ok", in_hook, len(issued))
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
