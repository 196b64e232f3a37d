"""Memories: per-tensor state that compensates the next gradient for what compression dropped."""

from grace_legacy.memories.basic import NoMemory, Residual
from grace_legacy.memories.dgc import DGCMemory
from grace_legacy.memories.ef21 import EF21

__all__ = ["DGCMemory", "EF21", "NoMemory", "Residual"]
