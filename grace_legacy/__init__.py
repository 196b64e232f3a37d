"""grace-legacy: compressed gradient communication for data-parallel PyTorch, with LEGACY.

Importing this package makes ``horovod.torch.DistributedOptimizer`` accept grace_legacy
compressors and ``Grace`` bundles (see :mod:`grace_legacy.horovod`) when Horovod is installed.
"""

from grace_legacy.communicators import Allgather, Allreduce, Broadcast
from grace_legacy.compressors import DGC, FP16, NoCompression, RandomK, Threshold, TopK
from grace_legacy.core import Communicator, Compressor, Knob, Memory
from grace_legacy.grace import Grace
from grace_legacy.legacy import Legacy
from grace_legacy.memories import EF21, DGCMemory, NoMemory, Residual

try:
    import horovod.torch  # noqa: F401
except ImportError:  # compressors and memories stay usable without Horovod
    pass
else:
    from grace_legacy.horovod import install as _install_horovod_integration

    _install_horovod_integration()

__version__ = "0.1.0"

__all__ = [
    "DGC", "EF21", "FP16", "Allgather", "Allreduce", "Broadcast", "Communicator", "Compressor", "DGCMemory", "Grace",
    "Knob", "Memory", "Legacy", "NoCompression", "NoMemory", "RandomK", "Residual", "Threshold", "TopK",
]
