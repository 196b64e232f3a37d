"""Allgather: gather every rank's packed payload and let the compressor aggregate them. A flight
of one tensor (see :mod:`grace_legacy.communicators.flight`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grace_legacy.communicators.flight import Flight, Member
from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Payload


class Allgather(Communicator):
    """Gathers every rank's payload, packed in one buffer (see :mod:`grace_legacy.core.wire`), and
    lets the compressor aggregate them. Payload sizes may differ between ranks."""

    route = "allgather"
    fusable = True

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Callable[[Payload, Any], None] | None = None) -> Pending:
        member = Member(name, payload, ctx, compressor, gathered=True, learn=on_final_payload)
        Flight(name, [member], backend, average)
        return member.pending
