"""The communicator interface: move payloads between ranks and turn them into the gradient.

A communicator is handed :class:`Parcel` objects, one per tensor: the payload, its context, the
compressor that made it, and the one callback through which error feedback learns what was really
sent (:meth:`Parcel.feed_back`). ``start`` sends one parcel; ``start_many`` sends a fused bucket's
parcels as one *flight* (our communicators: one collective of each kind for the whole bucket);
the default sends them one by one, so a communicator written outside this library works in fused
buckets too and fuses for real by overriding ``start_many`` (docs/IMPLEMENTING.md#communicators).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from grace_legacy.core.backend import Backend, Pending

if TYPE_CHECKING:
    from grace_legacy.core.compressor import Compressor, Payload
    from grace_legacy.core.memory import Encoder, Memory

#: ``feedback(payload, ctx, encoder)``: the memory learns from the last local payload, decoded by
#: ``encoder`` (``None``: the parcel's compressor)
Feedback = Callable[["Payload", Any, "Encoder | None"], None]


@dataclass(eq=False)
class Parcel:
    """One tensor on its way, as the bundle hands it to ``communicator``: ``payload`` and ``ctx``
    from ``compressor`` (or the uncompressed tensor as a one-part payload, for a communicator that
    :attr:`~Communicator.compresses` by itself); ``pending`` is what the caller waits on."""

    name: str
    payload: Payload
    ctx: Any
    compressor: Compressor
    communicator: Communicator
    #: error feedback (the bundle's), or ``None``
    feedback: Feedback | None = None
    #: the error feedback a two-phase owner applies to the sums of this tensor's segments, or ``None``
    owner_memory: Memory | None = None
    #: storage the caller lets the result be decoded into (:meth:`MultiRound.decompress_into`), or ``None``
    into: torch.Tensor | None = None
    pending: Pending = field(init=False)

    def __post_init__(self) -> None:
        self.pending = Pending(self._not_launched)

    def _not_launched(self) -> torch.Tensor:
        raise RuntimeError(f"the gradient of {self.name!r} was waited for before its bucket was complete")

    def feed_back(self, payload: Payload, ctx: Any, encoder: Encoder | None = None) -> None:
        """What every communicator calls once per parcel, with the last *local* payload it sends
        (before sending it: a collective may reduce it in place)."""
        if self.feedback is not None:
            self.feedback(payload, ctx, encoder)


class Flight(Protocol):
    """A fused bucket's collectives in the air."""

    #: allreduce rounds (PowerSGD: 2); later ones are launched by :meth:`advance`
    rounds: int

    def advance(self) -> bool:
        """Wait for the round in flight and launch the next (``True``), or nothing if it is the last."""
        ...


class Communicator(ABC):
    """Moves payloads between ranks and turns them into the aggregated gradient."""

    #: False for communicators that sum payloads and so cannot carry indices, signs or codes.
    carries_non_additive: ClassVar[bool] = True
    #: The label byte accounting files this communicator's traffic under.
    route: ClassVar[str]
    #: Whether the bundle may send this communicator's tensors in fused buckets (:meth:`start_many`).
    fusable: ClassVar[bool] = False
    #: Whether it compresses the tensor itself (shard by shard): the bundle then hands it the
    #: compensated gradient as a one-part payload, with the compressor to use.
    compresses: ClassVar[bool] = False

    @abstractmethod
    def start(self, parcel: Parcel, backend: Backend, average: bool) -> Pending:
        """Launch the collectives of one tensor without waiting for them; return ``parcel.pending``,
        bound (:meth:`Pending.finish_with`) to what finishes them. Call ``parcel.feed_back`` once,
        with the last local payload, before sending it."""

    def check_compressor(self, compressor: Compressor) -> None:
        """Raise ``ValueError``, naming both, where this communicator cannot carry what ``compressor``
        sends (as a memory's ``check_compressor`` refuses a compressor it cannot learn from): a sum
        of payloads that are not additive, or shards of a compressor that needs several rounds or
        whole tensors. The bundle asks before its first step."""
        if not self.carries_non_additive and not compressor.traits.additive:
            raise ValueError(f"{self!r} sums payloads, but {compressor!r} sends a non-additive payload (indices, "
                             f"signs or per-rank scales) that would be corrupted by summing; use Allgather()")
        if self.compresses and compressor.traits.rounds != 1:
            raise ValueError(f"{self!r} cannot run {compressor!r}, which needs {compressor.traits.rounds} allreduce "
                             f"rounds")
        if self.compresses and not compressor.traits.shardable:
            raise ValueError(f"{self!r} compresses shards of tensors, but {compressor!r} compresses whole tensors "
                             f"only; use Allgather()")

    def start_many(self, label: str, parcels: Sequence[Parcel], backend: Backend, average: bool,
                   into: torch.Tensor | None = None, pool: Any = None) -> Flight | None:
        """Launch a fused bucket's parcels: those of every communicator of the bucket whose class
        shares this method (Allreduce's and Allgather's share one flight), in the bucket's order,
        the same on every rank; ``label`` names the bucket's collectives. Default: one :meth:`start`
        each. ``into``: a 1-D tensor of the parcels' total length, read no more, where their results
        may be decoded back to back (the DDP bucket); ``pool``: a ``BufferPool`` the bundle keeps for
        the bucket's large buffers. Returns the flight where it has later rounds to advance."""
        for parcel in parcels:
            self.start(parcel, backend, average)
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
