"""Allreduce for additive payloads, allgather for any payload."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grace_legacy import wire
from grace_legacy.core import Backend, Communicator, Compressor, Payload, Pending


def _nbytes(parts: Payload) -> int:
    return sum(part.numel() * part.element_size() for part in parts)


class Allreduce(Communicator):
    """Sums (or averages) each payload part over ranks, then decompresses once:
    ``D(mean_r p_r)``, which equals ``mean_r D(p_r)`` for an additive compressor."""

    carries_non_additive = False
    route = "allreduce"

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Callable[[Payload, Any], None] | None = None) -> Pending:
        def launch(parts: Payload, round_index: int) -> list[Any]:
            return [backend.allreduce_async(part, f"{name}.r{round_index}.{i}", average)
                    for i, part in enumerate(parts)]

        handles = launch(payload, 0)
        if compressor.rounds == 1 and on_final_payload is not None:
            on_final_payload(payload, ctx)
        pending: Pending

        def finish():
            nonlocal ctx
            reduced = [backend.wait(h) for h in handles]
            for round_index in range(1, compressor.rounds):
                local, ctx = compressor.next_round(reduced, ctx)
                pending.bytes_sent += _nbytes(local)
                if round_index == compressor.rounds - 1 and on_final_payload is not None:
                    on_final_payload(local, ctx)
                reduced = [backend.wait(h) for h in launch(local, round_index)]
            if compressor.rounds > 1:
                compressor.end_exchange(reduced, ctx)
            return compressor.decompress(reduced, ctx)

        pending = Pending(finish, _nbytes(payload))
        return pending


class Allgather(Communicator):
    """Gathers every rank's payload, packed in one buffer (see :mod:`grace_legacy.wire`), and
    lets the compressor aggregate them. Payload sizes may differ between ranks."""

    route = "allgather"

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Callable[[Payload, Any], None] | None = None) -> Pending:
        if compressor.rounds != 1:
            raise ValueError(f"Allgather cannot run {compressor!r}: it needs {compressor.rounds} allreduce rounds")
        if on_final_payload is not None:
            on_final_payload(payload, ctx)
        with_header = not compressor.uniform_payload
        buffer = wire.pack(payload, with_header)
        handle = backend.allgather_async(buffer, f"{name}.r0.0")

        def finish():
            gathered = backend.wait(handle)
            payloads = wire.unpack_gathered(gathered, payload, backend.size(), with_header, name)
            return compressor.aggregate(payloads, ctx, average)

        return Pending(finish, buffer.numel())
