"""Allreduce for additive payloads, allgather for any payload."""

from __future__ import annotations

from typing import Any

from grace_legacy import wire
from grace_legacy.core import Backend, Communicator, Compressor, Payload, Pending


class Allreduce(Communicator):
    """Sums (or averages) each payload part over ranks, then decompresses once:
    ``D(mean_r p_r)``, which equals ``mean_r D(p_r)`` for an additive compressor."""

    carries_non_additive = False
    route = "allreduce"

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor,
              backend: Backend, average: bool) -> Pending:
        handles = [backend.allreduce_async(part, f"{name}.{i}", average) for i, part in enumerate(payload)]

        def finish():
            return compressor.decompress([backend.wait(h) for h in handles], ctx)

        return Pending(finish, sum(part.numel() * part.element_size() for part in payload))


class Allgather(Communicator):
    """Gathers every rank's payload, packed in one buffer (see :mod:`grace_legacy.wire`), and
    lets the compressor aggregate them. Payload sizes may differ between ranks."""

    route = "allgather"

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor,
              backend: Backend, average: bool) -> Pending:
        with_header = not compressor.uniform_payload
        buffer = wire.pack(payload, with_header)
        handle = backend.allgather_async(buffer, name)

        def finish():
            gathered = backend.wait(handle)
            payloads = wire.unpack_gathered(gathered, payload, backend.size(), with_header, name)
            return compressor.aggregate(payloads, ctx, average)

        return Pending(finish, buffer.numel())
