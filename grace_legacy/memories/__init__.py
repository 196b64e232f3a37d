"""Memories: per-tensor state that compensates the next gradient for what compression dropped."""

from grace_legacy.memories.basic import NoMemory, PowerSGDMemory, Residual

__all__ = ["NoMemory", "PowerSGDMemory", "Residual"]
