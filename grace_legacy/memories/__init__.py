"""Memories: per-tensor state that compensates the next gradient for what compression dropped."""

from grace_legacy.memories.basic import NoMemory, PowerSGDMemory, Residual
from grace_legacy.memories.dgc import DGCMemory
from grace_legacy.memories.ef21 import EF21
from grace_legacy.memories.efsignsgd import EFSignSGDMemory

__all__ = [
    "DGCMemory",
    "EF21",
    "EFSignSGDMemory",
    "NoMemory",
    "PowerSGDMemory",
    "Residual",
]
