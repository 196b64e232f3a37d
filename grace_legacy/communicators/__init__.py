"""Communicators: move payloads between ranks through a backend and aggregate them."""

from grace_legacy.communicators.allgather import Allgather
from grace_legacy.communicators.allreduce import Allreduce
from grace_legacy.communicators.broadcast import Broadcast

__all__ = ["Allgather", "Allreduce", "Broadcast"]
