"""grace-legacy: compressed gradient communication for data-parallel PyTorch, with LEGACY.

The public names are the compressors, memories and communicators of the subpackages, plus
``Grace`` (a compressor + memory + communicator bundle), ``Legacy`` (the scheduler) and the
adaptive schedules ``DGCWarmup``, ``Accordion`` and ``LGreCo``.
Importing this package makes ``horovod.torch.DistributedOptimizer`` accept grace_legacy
compressors and ``Grace`` bundles (see :mod:`grace_legacy.horovod`) when Horovod is installed.
"""

from grace_legacy import communicators, compressors, memories
from grace_legacy.adaptive import Accordion as Accordion
from grace_legacy.adaptive import DGCWarmup as DGCWarmup
from grace_legacy.adaptive import LGreCo as LGreCo
from grace_legacy.communicators import *  # noqa: F403  (each subpackage's __all__ is public)
from grace_legacy.compressors import *  # noqa: F403
from grace_legacy.consistency import RanksDisagree as RanksDisagree
from grace_legacy.core import Communicator as Communicator
from grace_legacy.core import Compressor as Compressor
from grace_legacy.core import Knob as Knob
from grace_legacy.core import Memory as Memory
from grace_legacy.grace import Grace as Grace
from grace_legacy.legacy import Legacy as Legacy
from grace_legacy.memories import *  # noqa: F403

try:
    import horovod.torch  # noqa: F401
except ImportError:  # compressors and memories stay usable without Horovod
    pass
else:
    from grace_legacy.horovod import install as _install_horovod_integration

    _install_horovod_integration()

__version__ = "0.1.0"

__all__ = sorted([
    "Accordion", "Communicator", "Compressor", "DGCWarmup", "Grace", "Knob", "LGreCo", "Legacy", "Memory",
    "RanksDisagree",
    *communicators.__all__, *compressors.__all__, *memories.__all__,
])
