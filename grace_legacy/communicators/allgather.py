"""Allgather: gather every rank's packed payload and let the compressor aggregate them."""

from __future__ import annotations

from grace_legacy.communicators.exchange import ExchangeCommunicator


class Allgather(ExchangeCommunicator):
    """Gathers every rank's payload, packed in one buffer (see :mod:`grace_legacy.runtime.wire`), and
    lets the compressor aggregate them. Payload sizes may differ between ranks. A flight of one
    tensor (see :mod:`grace_legacy.communicators.exchange`)."""

    route = "allgather"
