"""Memories: per-tensor state a rank carries between steps (error feedback and its relatives)."""

from grace_legacy.core.memory import NoMemory
from grace_legacy.memories.dgc import DGCMemory
from grace_legacy.memories.ef21 import EF21
from grace_legacy.memories.efsignsgd import EFSignSGDMemory
from grace_legacy.memories.powersgd import PowerSGDMemory
from grace_legacy.memories.residual import Residual

__all__ = ["DGCMemory", "EF21", "EFSignSGDMemory", "NoMemory", "PowerSGDMemory", "Residual"]
