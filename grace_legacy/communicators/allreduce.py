"""Allreduce: sum (or average) each payload part over ranks, then decode once."""

from __future__ import annotations

from grace_legacy.communicators.exchange import ExchangeCommunicator


class Allreduce(ExchangeCommunicator):
    """Sums (or averages) each payload part over ranks, then decodes once: ``D(mean_r p_r)``, which is
    ``mean_r D(p_r)`` for an additive compressor; one allreduce per round (PowerSGD)."""

    carries_non_additive = False
    route = "allreduce"
