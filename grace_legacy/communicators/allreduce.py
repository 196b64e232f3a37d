"""Allreduce: sum (or average) each payload part over ranks, then decode once. A flight of one
tensor (see :mod:`grace_legacy.communicators.flight`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grace_legacy.communicators.flight import Flight, Member
from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Payload


class Allreduce(Communicator):
    """Sums (or averages) each payload part over ranks, then decompresses once:
    ``D(mean_r p_r)``, which equals ``mean_r D(p_r)`` for an additive compressor. Multi-round
    compressors (PowerSGD) get one allreduce per round."""

    carries_non_additive = False
    route = "allreduce"
    fusable = True

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Callable[[Payload, Any], None] | None = None) -> Pending:
        member = Member(name, payload, ctx, compressor, gathered=False, learn=on_final_payload)
        Flight(name, [member], backend, average)
        return member.pending
