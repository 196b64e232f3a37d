"""Communicators: move payloads between ranks through a backend and aggregate them."""

from grace_legacy.communicators.allgather import Allgather
from grace_legacy.communicators.allreduce import Allreduce
from grace_legacy.communicators.broadcast import Broadcast
from grace_legacy.communicators.scatter_gather import ScatterGather

__all__ = ["Allgather", "Allreduce", "Broadcast", "ScatterGather"]
