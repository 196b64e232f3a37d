"""The interfaces every layer implements or talks to: Compressor (with its Traits), Memory,
Communicator, Backend and ScheduledParameter. One step's data flow:
docs/ARCHITECTURE.md#one-step-one-way (only ``payload`` leaves a rank, ``ctx`` never does).
This package imports nothing else of grace_legacy."""

from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator, Parcel
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.traits import Traits

__all__ = ["Backend", "Communicator", "Compressor", "ScheduledParameter", "Memory", "NoMemory", "Parcel", "Payload",
           "Pending", "Traits"]
