"""Memories: per-tensor state that compensates the next gradient for what compression dropped."""

from grace_legacy.memories.basic import NoMemory, Residual

__all__ = ["NoMemory", "Residual"]
