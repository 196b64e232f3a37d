"""grace-legacy: compressed gradient communication for data-parallel PyTorch, with LEGACY.

The public names are the compressors, memories and communicators of the subpackages, ``Grace``
(a compressor + memory + communicator bundle), the schedules ``Legacy``, ``DGCWarmup``,
``Accordion`` and ``LGreCo``, and what a user needs to write a compressor, memory, communicator or
schedule of their own (``Compressor``, ``Memory``, ``Communicator``, ``ScheduledParameter``, ``Schedule``,
``Backend``, ``Pending``), and the errors a run can raise (``RanksDisagree``, ``RanksStalled``).

GRACE users keep their scripts: ``grace_from_params(params)`` reads GRACE's parameter dictionary
(:mod:`grace_legacy.helper`), ``hvd.DistributedOptimizer(opt, grace=...)`` takes its result, and
``LegacyCompressor`` is ``Legacy`` under the name of the LEGACY design card.
``DistributedOptimizer`` (with Horovod installed) is :func:`grace_legacy.optimizer.DistributedOptimizer`.

Importing this package makes ``horovod.torch.DistributedOptimizer`` accept grace_legacy
compressors, schedules and ``Grace`` bundles when Horovod is installed (see
:mod:`grace_legacy.optimizer`; ``grace_legacy.optimizer.uninstall()`` undoes it), and makes
``hvd.elastic.TorchState`` save, restore and synchronize their state (:mod:`grace_legacy.elastic`,
whose ``uninstall()`` undoes that). Without Horovod everything else works.
"""


from grace_legacy import communicators, compressors, memories, schedules
from grace_legacy.communicators import *  # noqa: F403  (each subpackage's __all__ is public)
from grace_legacy.compressors import *  # noqa: F403
from grace_legacy.consistency import RanksDisagree as RanksDisagree
from grace_legacy.core import Backend as Backend
from grace_legacy.core import Communicator as Communicator
from grace_legacy.core import Compressor as Compressor
from grace_legacy.core import Memory as Memory
from grace_legacy.core import Parcel as Parcel
from grace_legacy.core import Pending as Pending
from grace_legacy.core import ScheduledParameter as ScheduledParameter
from grace_legacy.core import Traits as Traits
from grace_legacy.grace import Grace as Grace
from grace_legacy.helper import grace_from_params as grace_from_params
from grace_legacy.memories import *  # noqa: F403
from grace_legacy.runtime.stall import RanksStalled as RanksStalled
from grace_legacy.schedules import *  # noqa: F403
from grace_legacy.schedules import Legacy as LegacyCompressor  # noqa: F401  (the design card's name)

try:
    import horovod.torch  # noqa: F401
except ImportError:  # compressors, memories and schedules stay usable without Horovod
    _HOROVOD_NAMES: list[str] = []
else:
    from grace_legacy.elastic import install as _install_elastic_state
    from grace_legacy.optimizer import DistributedOptimizer as DistributedOptimizer
    from grace_legacy.optimizer import install as _install_horovod_integration

    _HOROVOD_NAMES = ["DistributedOptimizer"]

    _install_horovod_integration()
    _install_elastic_state()

__version__ = "0.1.0"

__all__ = sorted([
    "Backend", "Communicator", "Compressor", "Grace", "ScheduledParameter", "LegacyCompressor", "Memory", "Parcel",
    "Traits",
    "Pending",
    "RanksDisagree", "RanksStalled", "grace_from_params", *_HOROVOD_NAMES,
    *communicators.__all__, *compressors.__all__, *memories.__all__, *schedules.__all__,
])
