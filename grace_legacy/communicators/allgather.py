"""Allgather: gather every rank's packed payload and let the compressor aggregate them."""

from __future__ import annotations

from grace_legacy.communicators.flight import SingleFlight


class Allgather(SingleFlight):
    """Gathers every rank's payload, packed in one buffer (see :mod:`grace_legacy.core.wire`), and
    lets the compressor aggregate them. Payload sizes may differ between ranks. A flight of one
    tensor (see :mod:`grace_legacy.communicators.flight`)."""

    route = "allgather"
