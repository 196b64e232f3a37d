"""A DDP user installs grace_legacy without Horovod: with ``import horovod`` failing, importing
``grace_legacy`` and ``grace_legacy.ddp`` works and a one-process Gloo DDP step runs through the
hook (in a subprocess, so that this test process's own imports do not interfere)."""

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys


    class NoHorovod(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "horovod" or name.startswith("horovod."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None


    sys.meta_path.insert(0, NoHorovod())
    try:
        import horovod  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker did not block horovod")

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import grace_legacy
    import grace_legacy.ddp
    from grace_legacy import Legacy, TopK

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    ddp = DistributedDataParallel(model)
    state = grace_legacy.ddp.register(ddp, Legacy(TopK(), by="layer", values=[1.0, 0.1], splits=[100]))
    ddp(torch.randn(4, 30)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert state.stats["tensors_by_route"], state.stats
    assert not any(name.startswith("horovod") for name in sys.modules)
    print("ok", sorted(state.stats["tensors_by_route"]))
""")


def test_grace_legacy_and_the_ddp_hook_work_without_horovod(tmp_path):
    port = free_port()
    script = tmp_path / "no_horovod.py"
    script.write_text(SCRIPT.replace("{port}", str(port)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                            cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok"), result.stdout
