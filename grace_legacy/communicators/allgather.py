"""Allgather: gather every rank's packed payload and let the compressor aggregate them."""

from __future__ import annotations

from grace_legacy.communicators.exchange import ExchangeCommunicator


class Allgather(ExchangeCommunicator):
    """Gathers every rank's payload, packed in one buffer (sizes may differ between ranks), and lets
    the compressor aggregate them."""

    route = "allgather"
