"""Memories: per-tensor state that compensates the next gradient for what compression dropped."""

from grace_legacy.memories.basic import NoMemory, PowerSGDMemory, Residual
from grace_legacy.memories.efsignsgd import EFSignSGDMemory

__all__ = [
    "EFSignSGDMemory",
    "NoMemory",
    "PowerSGDMemory",
    "Residual",
]
