"""Memories: per-tensor state that compensates the next gradient for what compression dropped."""

from grace_legacy.memories.basic import NoMemory, Residual
from grace_legacy.memories.dgc import DGCMemory

__all__ = ["DGCMemory", "NoMemory", "Residual"]
