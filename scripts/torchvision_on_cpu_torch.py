"""Make the installed torchvision importable next to a CPU build of torch (run by setup.sh).

Why: PyPI's torchvision wheel is built against PyPI's CUDA torch; its compiled ops (``_C.so``)
link ``libtorch_cuda.so`` and ``libc10_cuda.so``, which a CPU torch does not ship. torchvision
means to carry on without its compiled ops (models, transforms), but two of its fake-kernel
registrations (``torchvision::nms`` and ``torchvision::qnms``) run unguarded, so ``import
torchvision`` fails with "operator torchvision::nms does not exist" (upstream:
pytorch/vision#9337). This guards those two registrations the way torchvision guards the others
(only when its ops loaded). Classification models need none of these ops; calling ``nms`` still
raises torchvision's own "Couldn't load custom C++ ops" error.

Does nothing when torchvision already imports (a CUDA torch, or torchvision's CPU build).
Exits non-zero if torchvision still does not import afterwards.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

UNGUARDED = '@torch.library.register_fake("torchvision::'
GUARDED = '@_register_fake_if_ops("torchvision::'
HELPER = '''

def _register_fake_if_ops(op_name):
    # Added by grace-legacy's set-up (scripts/torchvision_on_cpu_torch.py): register only when the
    # compiled ops loaded, as register_meta does; see pytorch/vision#9337.
    if torchvision.extension._has_ops():
        return torch.library.register_fake(op_name)
    return lambda fn: fn
'''
ANCHOR = "import torchvision.extension  # noqa: F401\n"


def imports() -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import torchvision.models; torchvision.models.resnet18()"],
                          capture_output=True, text=True)


def main() -> int:
    if importlib.util.find_spec("torchvision") is None:
        print("torchvision is not installed: nothing to do")
        return 0
    if imports().returncode == 0:
        return 0
    spec = importlib.util.find_spec("torchvision")
    path = Path(spec.origin).with_name("_meta_registrations.py")
    text = path.read_text()
    if GUARDED not in text:
        if UNGUARDED not in text or ANCHOR not in text:
            print(f"{path} does not have the expected registrations; cannot guard them", file=sys.stderr)
            return 1
        path.write_text(text.replace(ANCHOR, ANCHOR + HELPER, 1).replace(UNGUARDED, GUARDED))
        print(f"torchvision: its compiled ops do not load with this torch; guarded their fake kernels in {path}")
    result = imports()
    if result.returncode != 0:
        print(f"torchvision still does not import:\n{result.stderr[-3000:]}", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
