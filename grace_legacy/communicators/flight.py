"""Exchanging many tensors' payloads with one collective per kind, instead of one per tensor.

A *flight* carries a list of members (a tensor's payload, context and compressor) through:

* one allgather of every gathered member's packed buffer, back to back (:mod:`grace_legacy.core.wire`:
  each packed buffer is aligned and self-delimiting, so the concatenation needs no framing and
  costs exactly the bytes of the members sent one by one); a bucket of Top-k/DGC payloads goes
  *by part* instead (every member's values, then every member's indices) wherever that costs the
  same bytes, so it packs with two ``torch.cat`` and unpacks as two views, and all its members
  aggregate with one scatter-add;
* one allreduce per dtype of every additive member's parts, flattened and concatenated, and, for
  multi-round compressors (PowerSGD), one more such allreduce per further round.

The per-tensor communicators (:class:`~grace_legacy.communicators.Allreduce`,
:class:`~grace_legacy.communicators.Allgather`) are flights of one member; a fused bucket
(:mod:`grace_legacy.communicators.fusion`) is a flight of many."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grace_legacy.core import wire
from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.recycle import Recycler
from grace_legacy.core.sparse import bucket_positions, scatter_sum_columns, scatter_sum_many

Learn = Callable[[Payload, Any], None]


def nbytes(parts: Payload) -> int:
    return sum(part.numel() * part.element_size() for part in parts)


@dataclass
class Member:
    """One tensor's part of a flight."""

    name: str
    payload: Payload
    ctx: Any
    compressor: Compressor
    gathered: bool
    #: called with the last round's local payload (error feedback learns from it)
    learn: Learn | None = None
    pending: Pending = field(init=False)

    def __post_init__(self) -> None:
        sent = wire.packed_size(self.payload, not self.compressor.uniform_payload) if self.gathered \
            else nbytes(self.payload)
        self.pending = Pending(self._not_flown, sent)

    def _not_flown(self) -> torch.Tensor:
        raise RuntimeError(f"the gradient of {self.name!r} was waited for before its bucket was complete")


class Flight:
    """The collectives of one set of members, launched at construction and finished once."""

    def __init__(self, label: str, members: Sequence[Member], backend: Backend, average: bool,
                 recycler: Recycler | None = None) -> None:
        self.label, self.members, self.backend, self.average = label, list(members), backend, average
        #: keeps the buffer a by-part bucket aggregates into, for the next flight of the same label
        self.recycler = recycler
        self.results: dict[str, torch.Tensor] | None = None
        self._collectives = 0
        for member in self.members:
            if member.learn is not None and member.compressor.rounds == 1:
                member.learn(member.payload, member.ctx)
            if member.gathered and member.compressor.rounds != 1:
                raise ValueError(f"{member.compressor!r} needs {member.compressor.rounds} allreduce rounds; "
                                 f"it cannot be gathered")
            member.pending._finish = self._finisher(member.name)
        gathered = [m for m in self.members if m.gathered]
        self._gather = None
        if gathered:
            columns = self._by_part(gathered)
            if columns is not None:
                packed = wire.pack_columns([m.payload for m in gathered], columns)
                self._gather = (gathered, columns, backend.allgather_async(packed, self._name(0)))
            else:
                # Each member's parts and whether it carries a size header: how it is packed and unpacked.
                layouts = [(m.payload, not m.compressor.uniform_payload) for m in gathered]
                self._gather = (gathered, layouts, backend.allgather_async(wire.pack_many(layouts), self._name(0)))
        self._reduced = {id(m): list(m.payload) for m in self.members if not m.gathered}
        self._reduce = self._launch_reduce([m for m in self.members if not m.gathered], round_index=0)

    @staticmethod
    def _by_part(gathered: Sequence[Member]) -> wire.Columns | None:
        """The by-part layout (:func:`grace_legacy.core.wire.pack_columns`) when every member is a
        header-less ``[values, flat indices]`` scatter-add (Top-k, DGC), so that the whole bucket
        unpacks as two views and aggregates with one scatter-add, and the bytes on the wire
        stay those of the members packed one by one (``Pending.bytes_sent``); else ``None``."""
        if not all(m.compressor.uniform_payload and len(m.payload) == 2
                   and m.compressor.scatter_context(m.ctx) is not None for m in gathered):
            return None
        if len({m.payload[0].device for m in gathered}) != 1:  # torch.cat packs within one device
            return None
        columns = wire.columns([m.payload for m in gathered])
        if columns is None or columns.nbytes != sum(m.pending.bytes_sent for m in gathered):
            return None
        return columns

    def _name(self, round_index: int) -> str:
        # The i-th collective of a round: the same name whichever kind it is, so ranks that
        # disagree on a tensor's route meet Horovod's mismatch error instead of waiting forever.
        name = f"{self.label}.r{round_index}.{self._collectives}"
        self._collectives += 1
        return name

    def _launch_reduce(self, members: Sequence[Member], round_index: int) -> list[tuple[list, Any]]:
        by_dtype: dict[torch.dtype, list[tuple[Member, int]]] = {}
        for member in members:
            for i, part in enumerate(self._reduced[id(member)]):
                by_dtype.setdefault(part.dtype, []).append((member, i))
        if round_index > 0:
            self._collectives = 0
        launched = []
        for segments in by_dtype.values():
            parts = [self._reduced[id(m)][i] for m, i in segments]
            flat = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
            launched.append((segments, self.backend.allreduce_async(flat, self._name(round_index), self.average)))
        return launched

    def _wait_reduce(self, launched: list[tuple[list, Any]]) -> None:
        for segments, handle in launched:
            flat = self.backend.wait(handle)
            offset = 0
            for member, i in segments:
                template = self._reduced[id(member)][i]
                self._reduced[id(member)][i] = flat[offset: offset + template.numel()].view(template.shape)
                offset += template.numel()

    def _finisher(self, name: str) -> Callable[[], torch.Tensor]:
        def finish() -> torch.Tensor:
            if self.results is None:
                self.results = self._finish_all()
            return self.results[name]
        return finish

    def _finish_all(self) -> dict[str, torch.Tensor]:
        results: dict[str, torch.Tensor] = {}
        if self._gather is not None:
            results.update(self._aggregate_gathered(*self._gather))

        self._wait_reduce(self._reduce)
        reducing = [m for m in self.members if not m.gathered]
        rounds = max((m.compressor.rounds for m in reducing), default=1)
        for round_index in range(1, rounds):
            active = [m for m in reducing if m.compressor.rounds > round_index]
            for member in active:
                local, member.ctx = member.compressor.next_round(self._reduced[id(member)], member.ctx)
                member.pending.bytes_sent += nbytes(local)
                if round_index == member.compressor.rounds - 1 and member.learn is not None:
                    member.learn(local, member.ctx)
                self._reduced[id(member)] = list(local)
            self._wait_reduce(self._launch_reduce(active, round_index))
        for member in reducing:
            reduced = self._reduced[id(member)]
            if member.compressor.rounds > 1:
                member.compressor.end_exchange(reduced, member.ctx)
            results[member.name] = member.compressor.decompress(reduced, member.ctx)
        return results

    def _aggregate_gathered(self, members: list[Member], layout: wire.Columns | list[tuple[Payload, bool]],
                            handle: Any) -> dict[str, torch.Tensor]:
        if isinstance(layout, wire.Columns):
            contexts = [m.compressor.scatter_context(m.ctx) for m in members]
            # Zeroed before the wait: a rank that waits for the last bucket's gather is idle then.
            out = None if self.recycler is None else self.recycler.zeros(
                self.label, sum(ctx.numel for ctx in contexts), layout.dtypes[0], members[0].payload[0].device)
            gathered = self.backend.wait(handle)
            values, indices = wire.unpack_columns(gathered, layout, self.backend.size(), self.label)
            sums = scatter_sum_columns(values, indices, layout.counts[0], contexts, self.average, out=out)
            if out is not None:
                # Only the entries written can be inf or NaN: when none is, nobody needs to look
                # at the members' results again (Pending.finite).
                positions = bucket_positions(indices, layout.counts[0], contexts).reshape(-1)
                if bool(torch.isfinite(out.index_select(0, positions)).all()):
                    for member in members:
                        member.pending.finite = True
            return {m.name: total for m, total in zip(members, sums, strict=True)}
        gathered = self.backend.wait(handle)
        if any(with_header for _, with_header in layout):
            received = wire.unpack_gathered_many(gathered, layout, self.backend.size(), self.label)
            return {m.name: m.compressor.aggregate(payloads, m.ctx, self.average)
                    for m, payloads in zip(members, received, strict=True)}
        # Every rank sent the local layout: each part is one view over all ranks, and the members
        # whose aggregate is a scatter-add are aggregated together: one zero buffer and one
        # scatter-add for them instead of one each per member.
        results: dict[str, torch.Tensor] = {}
        scattered: list[tuple[str, tuple]] = []
        for member, parts in zip(members, wire.unpack_stacked(gathered, layout, self.backend.size(), self.label),
                                 strict=True):
            ctx = member.compressor.scatter_context(member.ctx)
            if ctx is not None:
                scattered.append((member.name, (parts[0], parts[1], ctx)))
                continue
            results[member.name] = member.compressor.aggregate(wire.per_rank(parts), member.ctx, self.average)
        sums = scatter_sum_many([entries for _, entries in scattered], self.average)
        results.update(zip((name for name, _ in scattered), sums, strict=True))
        return results


class SingleFlight(Communicator):
    """A communicator that sends each tensor as a flight of its own: gathered, or reduced by part
    (:attr:`carries_non_additive`). :class:`~grace_legacy.communicators.Allreduce` and
    :class:`~grace_legacy.communicators.Allgather` are its two settings."""

    fusable = True

    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Learn | None = None) -> Pending:
        member = Member(name, payload, ctx, compressor, gathered=self.carries_non_additive, learn=on_final_payload)
        Flight(name, [member], backend, average)
        return member.pending
