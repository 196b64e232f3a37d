"""A *flight*: many tensors' payloads (parcels) exchanged with one collective per kind: one allgather
of every gathered parcel's packed buffer back to back (exactly the bytes of the parcels sent one by
one; by part for Top-k/DGC buckets, aggregated by one scatter-add), and one allreduce per dtype of
the additive parcels' parts per round. ``Allreduce`` and ``Allgather`` are flights of one parcel, a
fused bucket a flight of many (docs/DESIGN.md#fused-buckets)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from grace_legacy.compressors.sparse import bucket_positions, scatter_sum_columns, scatter_sum_many
from grace_legacy.core.backend import Backend, Pending, computed_once
from grace_legacy.core.communicator import Communicator, Flight, Parcel
from grace_legacy.core.compressor import Payload
from grace_legacy.runtime import wire
from grace_legacy.runtime.buffers import BufferPool
from grace_legacy.runtime.cost import ring_allreduce_bytes


def nbytes(parts: Payload) -> int:
    return sum(part.numel() * part.element_size() for part in parts)


def finite_sum(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is floating point with a finite sum: then every entry is finite (an
    overflowing sum only sends its entries to be looked at one by one)."""
    return tensor.is_floating_point() and bool(torch.isfinite(
        tensor.sum(dtype=torch.float32 if tensor.element_size() < 4 else None)))


def gathered(parcel: Parcel) -> bool:
    """Whether ``parcel`` travels in the flight's allgather (else in its allreduces)."""
    return parcel.communicator.carries_non_additive


class BucketExchange:
    """The collectives of one set of parcels, launched at construction and finished once."""

    def __init__(self, label: str, parcels: Sequence[Parcel], backend: Backend, average: bool,
                 recycler: BufferPool | None = None, into: torch.Tensor | None = None) -> None:
        self.label, self.parcels, self.backend, self.average = label, list(parcels), backend, average
        self._gathered = {id(parcel): gathered(parcel) for parcel in self.parcels}
        #: keeps the buffer a by-part bucket aggregates into, for the next flight of the same label
        self.recycler = recycler
        #: a 1-D tensor the results may be decoded into, back to back in the parcels' order, when one
        #: allreduce carries every parcel whole (the DDP bucket the results go to anyway)
        self.into = into
        self.results: dict[str, torch.Tensor] | None = None
        self._collectives = 0
        self._failure: BaseException | None = None
        for parcel in self.parcels:
            is_gathered = self._gathered[id(parcel)]
            if is_gathered and parcel.compressor.traits.rounds != 1:
                raise ValueError(f"{parcel.compressor!r} needs {parcel.compressor.traits.rounds} allreduce rounds; "
                                 f"it cannot be gathered")
            parcel.pending.bytes_sent = wire.packed_size(parcel.payload, not parcel.compressor.traits.uniform_payload) \
                if is_gathered else nbytes(parcel.payload)
            if parcel.compressor.traits.rounds == 1:
                parcel.feed_back(parcel.payload, parcel.ctx)
        try:
            self._launch()
        except BaseException as error:
            # Launched whole or not at all: waiting for a parcel of a failed launch raises what the
            # launch raised (the engine's error), never something about a half-built exchange.
            for parcel in self.parcels:
                parcel.pending.fail_with(error)
            raise
        for parcel in self.parcels:
            parcel.pending.finish_with(self._finisher(parcel.name))

    def _launch(self) -> None:
        gathered = [m for m in self.parcels if self._gathered[id(m)]]
        self._gather = None
        if gathered:
            columns = self._by_part(gathered)
            if columns is not None:
                packed = wire.pack_columns([m.payload for m in gathered], columns)
                self._gather = (gathered, columns, self.backend.allgather_async(packed, self._name(0)))
            else:
                # Each parcel's parts and whether it carries a size header: how it is packed and unpacked.
                layouts = [(m.payload, not m.compressor.traits.uniform_payload) for m in gathered]
                self._gather = (gathered, layouts,
                                self.backend.allgather_async(wire.pack_many(layouts), self._name(0)))
        self._reducing = [m for m in self.parcels if not self._gathered[id(m)]]
        self._reduced = {id(m): list(m.payload) for m in self._reducing}
        for parcel in self._reducing:
            parcel.pending.wire_bytes = ring_allreduce_bytes(parcel.pending.bytes_sent, self.backend.size())
        #: the allreduce rounds of the additive parcels; the one whose allreduces are in flight
        self.rounds = max((m.compressor.traits.rounds for m in self._reducing), default=1)
        self._round = 0
        self._reduce = self._launch_reduce(self._reducing, round_index=0)

    @staticmethod
    def _by_part(gathered: Sequence[Parcel]) -> wire.Columns | None:
        """The by-part layout (:func:`~grace_legacy.runtime.wire.pack_columns`) when every parcel is a
        header-less ``[values, flat indices]`` scatter-add (Top-k, DGC) and it costs the bytes of the
        parcels packed one by one; else ``None``."""
        if not all(m.compressor.traits.uniform_payload and len(m.payload) == 2
                   and m.compressor.scatter_context(m.ctx) is not None for m in gathered):
            return None
        if len({m.payload[0].device for m in gathered}) != 1:  # torch.cat packs within one device
            return None
        columns = wire.columns([m.payload for m in gathered])
        if columns is None or columns.nbytes != sum(m.pending.bytes_sent for m in gathered):
            return None
        return columns

    def _name(self, round_index: int) -> str:
        # The i-th collective of a round, whatever its kind (docs/DESIGN.md#collective-names).
        name = f"{self.label}.r{round_index}.{self._collectives}"
        self._collectives += 1
        return name

    def _launch_reduce(self, parcels: Sequence[Parcel], round_index: int) -> list[tuple[list, Any]]:
        by_dtype: dict[torch.dtype, list[tuple[Parcel, int]]] = {}
        for parcel in parcels:
            for i, part in enumerate(self._reduced[id(parcel)]):
                by_dtype.setdefault(part.dtype, []).append((parcel, i))
        if round_index > 0:
            self._collectives = 0
        launched = []
        for segments in by_dtype.values():
            parts = [self._reduced[id(m)][i] for m, i in segments]
            if len(parts) == 1:
                handle = self.backend.allreduce_async(parts[0].reshape(-1), self._name(round_index), self.average)
            else:
                # A concatenation nobody else holds: a backend that can reduce it in place is given it.
                flat = torch.cat([p.reshape(-1) for p in parts])
                reduce = getattr(self.backend, "allreduce_owned_async", self.backend.allreduce_async)
                handle = reduce(flat, self._name(round_index), self.average)
            launched.append((segments, handle))
        return launched

    def _wait_reduce(self, launched: list[tuple[list, Any]],
                     results: dict[str, torch.Tensor] | None = None) -> None:
        """Wait for a round's allreduces; each parcel's parts become views of the reduced flats.
        With ``results`` (the last round of single-round parcels), a flat whose parcels decode at
        once is decoded into it instead (:meth:`_decompress_flat`)."""
        for segments, handle in launched:
            flat = self.backend.wait(handle)
            if results is not None and self._decompress_flat(segments, flat, results):
                continue
            templates = [self._reduced[id(parcel)][i] for parcel, i in segments]
            sizes = [t.numel() for t in templates]
            # One split for every part (a view each), reshaped only where a part is not flat.
            pieces = flat[:sum(sizes)].split(sizes)
            for (parcel, i), template, piece in zip(segments, templates, pieces, strict=True):
                self._reduced[id(parcel)][i] = piece if template.dim() == 1 else piece.view(template.shape)
            if self.rounds > 1 and self._round == 0:
                self._settle_dense(segments, flat)

    @staticmethod
    def _settle_dense(segments: list[tuple[Parcel, int]], flat: torch.Tensor) -> None:
        """A multi-round flight's first flat also carries the tensors sent as they are (a
        lossless single-round payload, whose result is its part of the flat): when the whole flat's
        sum is finite, so is each of theirs, and nobody needs to look at them again
        (Pending.finite)."""
        dense = [parcel for parcel, _ in segments
                 if parcel.compressor.traits.rounds == 1 and parcel.compressor.traits.lossless]
        if dense and finite_sum(flat):
            for parcel in dense:
                parcel.pending.finite = True

    def _decompress_flat(self, segments: list[tuple[Parcel, int]], flat: torch.Tensor,
                         results: dict[str, torch.Tensor]) -> bool:
        """Decode a flat of one-part payloads of one compressor at once
        (:meth:`~grace_legacy.core.compressor.Elementwise.decompress_flat`) into ``results``, and look
        at it whole for infs and NaNs; ``False`` where the compressor is not elementwise."""
        compressor = segments[0][0].compressor
        if not compressor.traits.elementwise or not all(
                parcel.compressor is compressor and len(parcel.payload) == 1 for parcel, _ in segments):
            return False
        whole = len(segments) == len(self.parcels) and all(
            parcel is mine for (parcel, _), mine in zip(segments, self.parcels, strict=True))
        out = compressor.decompress_flat(flat, [parcel.ctx for parcel, _ in segments],
                                         self.into if whole else None)
        if out is None:
            return False
        offset = 0
        for parcel, _ in segments:
            shape = parcel.payload[0].shape
            results[parcel.name] = out[offset: offset + shape.numel()].view(shape)
            offset += shape.numel()
        # Then nobody needs to look at the parcels' results again (Pending.finite).
        if finite_sum(out):
            for parcel, _ in segments:
                parcel.pending.finite = True
        return True

    def advance(self) -> bool:
        """Wait for the allreduces of the round in flight and launch the next round's (``True``), or
        do nothing when the round in flight is the last (``False``). A caller with several flights
        advances each in turn, so that one flight's round travels while another's is computed;
        waiting for a parcel finishes whatever rounds are left."""
        if self._failure is not None:
            raise self._failure
        if self._round + 1 >= self.rounds:
            return False
        try:
            self._wait_reduce(self._reduce)
            self._round += 1
            round_index = self._round
            active = [m for m in self._reducing if m.compressor.traits.rounds > round_index]
            for parcel in active:
                local, parcel.ctx = parcel.compressor.next_round(self._reduced[id(parcel)], parcel.ctx)
                parcel.pending.bytes_sent += nbytes(local)
                parcel.pending.wire_bytes += ring_allreduce_bytes(nbytes(local), self.backend.size())
                if round_index == parcel.compressor.traits.rounds - 1:
                    parcel.feed_back(local, parcel.ctx)
                self._reduced[id(parcel)] = list(local)
            self._reduce = self._launch_reduce(active, round_index)
        except BaseException as error:
            self._failure = error  # every parcel of the exchange raises it: its handles are spent
            raise
        return True

    def _finisher(self, name: str) -> Callable[[], torch.Tensor]:
        def finish() -> torch.Tensor:
            if self._failure is not None:
                raise self._failure
            if self.results is None:
                try:
                    self.results = self._finish_all()
                except BaseException as error:
                    # Every parcel of the exchange raises the same error: its handles are spent.
                    self._failure = error
                    raise
            return self.results[name]
        return finish

    def _finish_all(self) -> dict[str, torch.Tensor]:
        results: dict[str, torch.Tensor] = {}
        if self._gather is not None:
            results.update(self._aggregate_gathered(*self._gather))
            self._count_gathered(*self._gather)

        while self.advance():
            pass
        # With one round, each dtype's flat holds its parcels' whole payloads.
        self._wait_reduce(self._reduce, results if self.rounds == 1 else None)
        for parcel in self._reducing:
            if parcel.name in results:
                continue
            reduced = self._reduced[id(parcel)]
            decoded = None
            if parcel.compressor.traits.rounds > 1:
                # Known from the last round's sum, before end_exchange may keep it.
                parcel.pending.finite = parcel.compressor.surely_finite(reduced, parcel.ctx)
                parcel.compressor.end_exchange(reduced, parcel.ctx)
                if parcel.into is not None:
                    decoded = parcel.compressor.decompress_into(reduced, parcel.ctx, parcel.into)
            results[parcel.name] = parcel.compressor.decompress(reduced, parcel.ctx) if decoded is None else decoded
        return results

    def _count_gathered(self, parcels: list[Parcel], layout: wire.Columns | list[tuple[Payload, bool]],
                        handle: Any) -> None:
        """Each gathered parcel's link bytes: the other ranks' parts of it. Without a header every
        rank's part has this rank's size; with one, the sizes were read on arrival."""
        others = self.backend.size() - 1
        for parcel in parcels:
            if parcel.compressor.traits.uniform_payload:
                parcel.pending.wire_bytes = float(others * parcel.pending.bytes_sent)

    def _aggregate_gathered(self, parcels: list[Parcel], layout: wire.Columns | list[tuple[Payload, bool]],
                            handle: Any) -> dict[str, torch.Tensor]:
        if isinstance(layout, wire.Columns):
            contexts = [m.compressor.scatter_context(m.ctx) for m in parcels]
            # Zeroed before the wait: a rank that waits for the last bucket's gather is idle then.
            out = None if self.recycler is None else self.recycler.zeros(
                self.label, sum(ctx.numel for ctx in contexts), layout.dtypes[0], parcels[0].payload[0].device)
            gathered = self.backend.wait(handle)
            values, indices = wire.unpack_columns(gathered, layout, self.backend.size(), self.label)

            def summed() -> tuple[list[torch.Tensor], bool]:
                sums = scatter_sum_columns(values, indices, layout.counts[0], contexts, self.average, out=out)
                if out is None:
                    return sums, False
                # Only the entries written can be inf or NaN: when none is, nobody needs to look
                # at the parcels' results again (Pending.finite).
                positions = bucket_positions(indices, layout.counts[0], contexts).reshape(-1)
                return sums, bool(torch.isfinite(out.index_select(0, positions)).all())

            sums, finite = computed_once(self.backend, handle, "columns", summed)
            for parcel in parcels:
                parcel.pending.finite = parcel.pending.finite or finite
            return {m.name: total for m, total in zip(parcels, sums, strict=True)}
        gathered = self.backend.wait(handle)
        if any(with_header for _, with_header in layout):
            received = wire.unpack_gathered_many(gathered, layout, self.backend.size(), self.label)
            me = self.backend.rank()
            for parcel, payloads, (_, with_header) in zip(parcels, received, layout, strict=True):
                parcel.pending.wire_bytes = float(sum(wire.packed_size(payload, with_header)
                                                      for rank, payload in enumerate(payloads) if rank != me))
            return {m.name: self._aggregate(handle, index, m, payloads)
                    for index, (m, payloads) in enumerate(zip(parcels, received, strict=True))}
        # Every rank sent the local layout: each part is one view over all ranks, and the
        # scatter-add parcels share one zero buffer and one scatter-add.
        results: dict[str, torch.Tensor] = {}
        scattered: list[tuple[str, tuple]] = []
        stacked = wire.unpack_stacked(gathered, layout, self.backend.size(), self.label)
        for index, (parcel, parts) in enumerate(zip(parcels, stacked, strict=True)):
            ctx = parcel.compressor.scatter_context(parcel.ctx)
            if ctx is not None:
                scattered.append((parcel.name, (parts[0], parts[1], ctx)))
                continue
            results[parcel.name] = self._aggregate(handle, index, parcel, wire.per_rank(parts))
        sums = computed_once(self.backend, handle, "scattered",
                             lambda: scatter_sum_many([entries for _, entries in scattered], self.average))
        results.update(zip((name for name, _ in scattered), sums, strict=True))
        return results

    def _aggregate(self, handle: Any, index: int, parcel: Parcel, payloads: Sequence[Payload]) -> torch.Tensor:
        """The gathered ``payloads`` of the flight's ``index``-th parcel combined by its compressor's
        rule: the same on every rank, so computed once where the backend hosts them all."""
        return computed_once(self.backend, handle, index,
                             lambda: parcel.compressor.aggregate(payloads, parcel.ctx, self.average))


class ExchangeCommunicator(Communicator):
    """Sends each tensor, or each fused bucket, as one flight: one allgather of the gathered
    parcels (:attr:`carries_non_additive`), one allreduce per dtype and round of the others."""

    fusable = True

    def start(self, parcel: Parcel, backend: Backend, average: bool) -> Pending:
        BucketExchange(parcel.name, [parcel], backend, average)
        return parcel.pending

    def start_many(self, label: str, parcels: Sequence[Parcel], backend: Backend, average: bool,
                   into: torch.Tensor | None = None, pool: Any = None) -> Flight | None:
        exchange = BucketExchange(label, parcels, backend, average, pool, into)
        return exchange if exchange.rounds > 1 else None
