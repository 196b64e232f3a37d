"""Communicators: move payloads between ranks through a backend and aggregate them."""

from grace_legacy.communicators.broadcast import Broadcast
from grace_legacy.communicators.collectives import Allgather, Allreduce

__all__ = ["Allgather", "Allreduce", "Broadcast"]
