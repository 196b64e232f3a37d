"""Allreduce: sum (or average) each payload part over ranks, then decode once."""

from __future__ import annotations

from grace_legacy.communicators.exchange import ExchangeCommunicator


class Allreduce(ExchangeCommunicator):
    """Sums (or averages) each payload part over ranks, then decompresses once:
    ``D(mean_r p_r)``, which equals ``mean_r D(p_r)`` for an additive compressor. Multi-round
    compressors (PowerSGD) get one allreduce per round. A flight of one tensor (see
    :mod:`grace_legacy.communicators.exchange`)."""

    carries_non_additive = False
    route = "allreduce"
