"""The communicator example of docs/IMPLEMENTING.md: a communicator written outside the library,
with only the public interface, that fuses a bucket into one collective as the library's own do.

``Float64Sum()`` carries additive payloads (FP16's casts, Random-k's shared-index values, dense
gradients) and sums them in float64, so that the sum does not depend on the order in which ranks'
values meet: each part is widened to float64, a bucket's parts travel back to back in one
allreduce, and each result is rounded once, back to the part's dtype, before it is decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grace_legacy import Backend, Communicator, Parcel, Pending


class Float64Sum(Communicator):
    """Sums each additive payload part in float64, a whole bucket in one allreduce."""

    carries_non_additive = False
    route = "allreduce"
    fusable = True

    def start(self, parcel: Parcel, backend: Backend, average: bool) -> Pending:
        self.start_many(parcel.name, [parcel], backend, average)
        return parcel.pending

    def start_many(self, label: str, parcels: Sequence[Parcel], backend: Backend, average: bool,
                   into: torch.Tensor | None = None, pool: Any = None) -> None:
        for parcel in parcels:
            if parcel.compressor.traits.rounds != 1:
                raise ValueError(f"Float64Sum sends one round; {parcel.compressor!r} needs "
                                 f"{parcel.compressor.traits.rounds}")
            parcel.feed_back(parcel.payload, parcel.ctx)  # the last local payload, before it is sent
        parts = [part for parcel in parcels for part in parcel.payload]
        flat = torch.cat([part.reshape(-1).to(torch.float64) for part in parts])
        handle = backend.allreduce_async(flat, f"{label}.float64", average)
        for parcel in parcels:
            parcel.pending.bytes_sent = sum(p.numel() * 8 for p in parcel.payload)
        results: dict[int, torch.Tensor] = {}

        def finish_all() -> None:
            summed, offset = backend.wait(handle), 0
            for parcel in parcels:
                reduced = []
                for part in parcel.payload:
                    reduced.append(summed[offset: offset + part.numel()].to(part.dtype).view(part.shape))
                    offset += part.numel()
                results[id(parcel)] = parcel.compressor.decompress(reduced, parcel.ctx)

        def finisher(parcel: Parcel):
            def finish() -> torch.Tensor:
                if not results:
                    finish_all()
                return results[id(parcel)]
            return finish

        for parcel in parcels:
            parcel.pending.finish_with(finisher(parcel))
        return None
