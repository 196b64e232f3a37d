"""Broadcast: every rank in turn sends its payload to all the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator, Parcel
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.runtime import wire


class Broadcast(Communicator):
    """``P`` broadcasts, rank ``r`` the root of the ``r``-th, each carrying that rank's packed payload;
    then the compressor aggregates them, exactly as after :class:`~grace_legacy.communicators.Allgather`,
    and ``bytes_sent`` is what an ``Allgather`` would count. Single-round compressors only.

    With ``uniform_payload`` the broadcasts start at once; otherwise (Threshold) the wire headers go
    first, in one allgather, and the bodies' broadcasts start when the gradient is collected
    (``pending()``; an empty body is skipped by all)."""

    route = "broadcast"

    def start(self, parcel: Parcel, backend: Backend, average: bool) -> Pending:
        payload, ctx, name, compressor = parcel.payload, parcel.ctx, parcel.name, parcel.compressor
        if compressor.traits.rounds != 1:
            raise ValueError(f"Broadcast cannot run {compressor!r}: it needs {compressor.traits.rounds} allreduce "
                             f"rounds")
        parcel.feed_back(payload, ctx)
        start = self._start_uniform if compressor.traits.uniform_payload else self._start_with_headers
        finish, parcel.pending.bytes_sent = start(payload, ctx, name, compressor, backend, average)
        parcel.pending.finish_with(finish)
        return parcel.pending

    @staticmethod
    def _launch(body: torch.Tensor, length: int, root: int, name: str, backend: Backend) -> Any:
        """Join root ``root``'s broadcast of a ``length``-byte body; ``None`` when it is empty
        (every rank knows the length, so every rank skips it)."""
        if length == 0:
            return None
        tensor = body if root == backend.rank() else torch.empty(length, dtype=torch.uint8, device=body.device)
        return backend.broadcast_async(tensor, root, name)

    def _start_uniform(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
                       average: bool) -> tuple[Callable[[], torch.Tensor], int]:
        body = wire.pack(payload, with_header=False)
        handles = [self._launch(body, body.numel(), root, name, backend) for root in range(backend.size())]

        def finish() -> torch.Tensor:
            bodies = [body.new_empty(0) if h is None else backend.wait(h) for h in handles]
            payloads = wire.unpack_gathered(torch.cat(bodies), payload, backend.size(), False, name)
            return compressor.aggregate(payloads, ctx, average)

        return finish, body.numel()

    def _start_with_headers(self, payload: Payload, ctx: Any, name: str, compressor: Compressor,
                            backend: Backend, average: bool) -> tuple[Callable[[], torch.Tensor], int]:
        packed = wire.pack(payload, with_header=True)
        # The same parts with no rows lay out as the header alone: its length, from wire itself.
        header_length = wire.layout(payload, [0] * len(payload), True)[1]
        header, body = packed[:header_length], packed[header_length:]
        header_handle = backend.allgather_async(header, f"{name}.header")
        size = backend.size()

        def finish() -> torch.Tensor:
            headers = backend.wait(header_handle)
            if headers.numel() != header_length * size:
                raise RuntimeError(f"Broadcast: the headers of {name!r} came back as {headers.numel()} bytes, "
                                   f"expected {header_length} from each of {size} ranks")
            rows = headers.view(size, header_length)
            totals = rows.view(torch.int64)[:, 0].tolist()
            lengths = [int(total) - header_length for total in totals]
            if lengths[backend.rank()] != body.numel() or min(lengths) < 0:
                raise RuntimeError(f"Broadcast: corrupt headers for {name!r}: buffer lengths {totals}")
            handles = [self._launch(body, length, root, name, backend) for root, length in enumerate(lengths)]
            pieces = []
            for root, handle in enumerate(handles):
                pieces += [rows[root], body.new_empty(0) if handle is None else backend.wait(handle)]
            # unpack_gathered checks every header against its body, as after an allgather.
            payloads = wire.unpack_gathered(torch.cat(pieces), payload, size, True, name)
            return compressor.aggregate(payloads, ctx, average)

        return finish, packed.numel()
