"""Broadcast: every rank in turn sends its payload to all the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.runtime import wire


class Broadcast(Communicator):
    """``P`` broadcasts, rank ``r`` the root of the ``r``-th, each carrying that rank's packed
    payload (:mod:`grace_legacy.runtime.wire`); then the compressor aggregates the ``P`` payloads, exactly
    as after :class:`~grace_legacy.communicators.Allgather`. Single-round compressors only.

    A broadcast's receivers must pass a buffer of the root's length, which they cannot know when
    payload sizes differ between ranks (``uniform_payload = False``: Threshold). Then:

    1. the wire header each rank would prepend for an allgather (its buffer length and each
       part's leading dimension, ``8 * (1 + parts)`` bytes) is exchanged by *one* allgather,
       launched at once;
    2. once it has arrived, every rank knows every root's body length and joins the ``P``
       broadcasts of the bodies (headerless; a root with an empty body is skipped by all).

    One allgather of a few words rather than ``P`` header broadcasts: one collective instead of
    ``P``, the same bytes. Each rank hands the backend its header and its body, which is byte for
    byte what it would hand an :class:`Allgather` (the header is a multiple of 8 bytes, so the
    body's layout is the same with or without it): ``stats`` and ``bytes_sent`` agree between
    the two communicators. The bodies can only be launched when the gradient is collected
    (``pending()``), since waiting for the headers earlier would stall the backward pass.

    With ``uniform_payload`` (TopK, DGC) every root's buffer has the local length: no header,
    and the ``P`` broadcasts are launched at once.
    """

    route = "broadcast"

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Callable[[Payload, Any], None] | None = None) -> Pending:
        if compressor.rounds != 1:
            raise ValueError(f"Broadcast cannot run {compressor!r}: it needs {compressor.rounds} allreduce rounds")
        if on_final_payload is not None:
            on_final_payload(payload, ctx)
        if compressor.uniform_payload:
            return self._start_uniform(payload, ctx, name, compressor, backend, average)
        return self._start_with_headers(payload, ctx, name, compressor, backend, average)

    @staticmethod
    def _launch(body: torch.Tensor, length: int, root: int, name: str, backend: Backend) -> Any:
        """Join root ``root``'s broadcast of a ``length``-byte body; ``None`` when it is empty
        (every rank knows the length, so every rank skips it)."""
        if length == 0:
            return None
        tensor = body if root == backend.rank() else torch.empty(length, dtype=torch.uint8, device=body.device)
        return backend.broadcast_async(tensor, root, name)

    def _start_uniform(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
                       average: bool) -> Pending:
        body = wire.pack(payload, with_header=False)
        handles = [self._launch(body, body.numel(), root, name, backend) for root in range(backend.size())]

        def finish() -> torch.Tensor:
            bodies = [body.new_empty(0) if h is None else backend.wait(h) for h in handles]
            payloads = wire.unpack_gathered(torch.cat(bodies), payload, backend.size(), False, name)
            return compressor.aggregate(payloads, ctx, average)

        return Pending(finish, body.numel())

    def _start_with_headers(self, payload: Payload, ctx: Any, name: str, compressor: Compressor,
                            backend: Backend, average: bool) -> Pending:
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

        return Pending(finish, packed.numel())
