"""Fusion: many tensors' parcels sent as one flight per communicator instead of one each
(:meth:`~grace_legacy.core.communicator.Communicator.start_many`), in one of four ways, one object
for the Horovod optimizer and the DDP hook alike:

* planned buckets (:meth:`Fusion.plan`): membership fixed from the parameter order, so every rank
  packs the same parcels in the same order; a bucket takes off as soon as its last parcel arrives;
* held parcels (``hold=True``), launched together when the caller says so: the DDP hook fuses by
  DDP's own buckets, and holds a multi-round compressor's buckets until the last one so that each
  round is one collective for the whole model (:meth:`Fusion.advance_held`);
* whole buckets (:meth:`Fusion.start_whole`): a caller's flat bucket compressed as one tensor where
  that computes what each tensor alone would, bit for bit (PyTorch's ``fp16_compress_hook`` does
  the same);
* the whole step (:meth:`Fusion.hold_for_step`), for a compressor that makes one selection over
  every gradient of the step (:attr:`~grace_legacy.core.traits.Traits.spans_step`:
  ``GlobalTopK``, ``CAT``): the raw gradients are held, and nothing is sent until the first result
  is asked for. Both integrations ask only once every gradient of the step has been started
  (``hvd.DistributedOptimizer.synchronize`` starts those the backward pass did not; the DDP hook
  waits at its last bucket), so this rank then holds the whole step. The gradients are laid end to
  end, one flat per dtype and device, in the order of their names (sorted: every rank lays them out
  alike, whatever order they arrived in), and the bundle compresses and sends each flat as one
  tensor under :func:`step_flat_name` (its error feedback, traffic row and collectives are the
  flat's). Each gradient's result is its slice of its flat's.

Why buckets, and their size: docs/DESIGN.md#fused-buckets."""

from __future__ import annotations

import functools
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grace_legacy.core.backend import Backend, Pending
from grace_legacy.core.communicator import Flight, Parcel
from grace_legacy.core.compressor import Compressor
from grace_legacy.runtime.buffers import BufferPool
from grace_legacy.runtime.cost import ring_allreduce_bytes
from grace_legacy.runtime.stall import RanksStalled
from grace_legacy.runtime.traffic import TrafficStats
from grace_legacy.runtime.validation import ArgumentTypeError, is_int

#: Horovod's own default fusion threshold, used when the environment sets none.
_HOROVOD_FUSION_DEFAULT = 64 * 1024 * 1024

#: The largest default bucket, below glibc's 32 MiB mmap ceiling (docs/DESIGN.md#bucket-cap).
BUCKET_BYTES_CAP = 16 * 1024 * 1024

#: ``start_flat(flat, name)``: the bundle's pipeline run on one flat of the step, its pending result.
StartFlat = Callable[[torch.Tensor, str], Pending]

_STEP_FLAT = "whole-step."


def default_bucket_bytes() -> int:
    """The smaller of ``HOROVOD_FUSION_THRESHOLD`` (read as Horovod reads it; its 64 MiB when
    unset, ``0`` for no fusion) and :data:`BUCKET_BYTES_CAP`."""
    setting = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if setting is None:
        return min(_HOROVOD_FUSION_DEFAULT, BUCKET_BYTES_CAP)
    try:
        threshold = int(setting)
    except ValueError:
        threshold = -1
    if threshold < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD must be a whole number of bytes >= 0, got {setting!r}")
    return min(threshold, BUCKET_BYTES_CAP)


def step_flat_name(dtype: torch.dtype, device: torch.device) -> str:
    """The name the step's flat of ``dtype`` on ``device`` is compressed and sent under."""
    where = "" if device.type == "cpu" else f".{device}"
    return f"{_STEP_FLAT}{str(dtype).removeprefix('torch.')}{where}"


@dataclass
class _StepFlat:
    """One flat of the step in flight: its pending result and where each gradient lies in it."""

    pending: Pending
    places: dict[str, tuple[int, torch.Size]]


def checked_bucket_bytes(value: object, owner: str) -> int:
    """``bucket_bytes`` as ``owner`` was given it: ``None`` for :func:`default_bucket_bytes`, else a
    whole number >= 0 (``ArgumentTypeError`` for what is not a number, ``ValueError`` for another)."""
    if value is None:
        return default_bucket_bytes()
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, torch.Tensor)):
        raise ArgumentTypeError(f"{owner}: bucket_bytes must be None or an integer >= 0, got {value!r} of type "
                                f"{type(value).__name__}")
    if not is_int(value) or value < 0:
        raise ValueError(f"{owner}: bucket_bytes must be None or an integer >= 0, got {value!r}")
    return int(value)


class BucketPlan:
    """Which tensors fly together: consecutive tensors, in the given order (best: the order their
    gradients are expected), filled up to ``bucket_bytes`` of *dense* size; a larger one flies alone."""

    def __init__(self, sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> None:
        if bucket_bytes < 0:
            raise ValueError(f"BucketPlan: bucket_bytes must be >= 0, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.buckets: list[list[str]] = []
        filled = bucket_bytes  # forces a new bucket for the first tensor
        for name, size in sizes:
            if not self.buckets or filled + size > bucket_bytes:
                self.buckets.append([])
                filled = 0
            self.buckets[-1].append(name)
            filled += size
        self.bucket_of = {name: index for index, names in enumerate(self.buckets) for name in names}
        if len(self.bucket_of) != sum(len(b) for b in self.buckets):
            raise ValueError("BucketPlan: tensor names must be unique")

    def __repr__(self) -> str:
        return f"BucketPlan({len(self.buckets)} buckets of up to {self.bucket_bytes} bytes)"


def launch(label: str, parcels: Sequence[Parcel], backend: Backend, average: bool, pool: BufferPool,
           into: torch.Tensor | None = None) -> list[Flight]:
    """Launch one bucket: its parcels grouped by the ``start_many`` of their communicators' classes
    (Allreduce's and Allgather's share one flight: one allgather, one allreduce per dtype; the
    scatter-gather's is another), each group in the bucket's order. ``into`` goes to a group that
    holds every parcel. Returns the flights with later rounds."""
    groups: dict[Callable, list[Parcel]] = {}
    for parcel in parcels:
        groups.setdefault(type(parcel.communicator).start_many, []).append(parcel)
    flights = []
    for members in groups.values():
        flight = members[0].communicator.start_many(label, members, backend, average,
                                                    into if len(members) == len(parcels) else None, pool)
        if flight is not None:
            flights.append(flight)
    return flights


class Fusion:
    """A bundle's fused sending (see the module docstring); ``bucket_bytes`` ``0``: no planned buckets;
    ``spans_step``: the bundle's compressor selects over the whole step."""

    def __init__(self, bucket_bytes: int, spans_step: bool = False) -> None:
        self.bucket_bytes = bucket_bytes
        self.spans_step = spans_step
        self.plan: BucketPlan | None = None
        self._open: dict[int, dict[str, Parcel]] = {}
        self._held: list[Parcel] = []
        # The held buckets of this step with rounds still to run.
        self._flights: list[Flight] = []
        # Each bucket's large buffers, used again by its next flight once the caller has let go.
        self._pool = BufferPool()
        # A whole bucket's tensors' traffic rows, the same every step.
        self._whole_rows: dict[tuple, list[tuple[int, int, float, float]] | None] = {}
        # The step's gradients held for its flats, what starts a flat, and the flats in flight.
        self._step_held: dict[str, torch.Tensor] = {}
        self._start_flat: StartFlat | None = None
        self._step_flats: dict[str, _StepFlat] = {}
        #: each held gradient's flat, by name (the same every step: a name keeps its dtype and device);
        #: its error feedback and the step's guards are the flat's
        self.flat_of: dict[str, str] = {}

    def plan_buckets(self, sizes: Sequence[tuple[str, int]]) -> None:
        """Fuse the tensors named in ``sizes`` ((name, dense bytes), in expected arrival order) into
        buckets of up to :attr:`bucket_bytes`. Every rank must give the same list."""
        self.plan = BucketPlan(sizes, self.bucket_bytes) if self.bucket_bytes else None

    def send(self, parcel: Parcel, backend: Backend, average: bool, hold: bool = False) -> Pending:
        """Send ``parcel``: held for :meth:`launch_held`, added to its planned bucket (launched when
        full), or alone where its communicator does not fuse or no bucket holds it."""
        if not parcel.communicator.fusable:
            return parcel.communicator.start(parcel, backend, average)
        if hold:
            self._held.append(parcel)
            return parcel.pending
        if self.plan is None or parcel.name not in self.plan.bucket_of:
            return parcel.communicator.start(parcel, backend, average)
        index = self.plan.bucket_of[parcel.name]
        entries = self._open.setdefault(index, {})
        if parcel.name in entries:
            raise RuntimeError(f"the gradient of {parcel.name!r} was sent twice in one step")
        entries[parcel.name] = parcel
        names = self.plan.buckets[index]
        if len(entries) == len(names):
            del self._open[index]
            launch(f"bucket{index}", [entries[n] for n in names], backend, average, self._pool)
        return parcel.pending

    def launch_held(self, label: str, backend: Backend, average: bool, into: torch.Tensor | None = None) -> None:
        """Launch the parcels held since the last launch as one bucket (``label`` names its
        collectives). ``into``: a 1-D tensor of their total length, read no more, where their results
        may be decoded back to back (DDP's bucket buffer)."""
        held, self._held = self._held, []
        if held:
            self._flights += launch(label, held, backend, average, self._pool, into)

    def holds_later_rounds(self) -> bool:
        """Whether a held parcel needs more than one allreduce round (PowerSGD): the same answer on
        every rank, which shares the configuration."""
        return any(parcel.compressor.traits.rounds > 1 for parcel in self._held)

    def advance_held(self) -> None:
        """Run the later rounds of every flight launched by :meth:`launch_held` since the last call,
        round by round across the flights in launch order: each flight's next round is launched as
        soon as its current one arrived, and travels while the others' are computed. The same issue
        order on every rank."""
        flights, self._flights = self._flights, []
        while flights:
            flights = [flight for flight in flights if flight.advance()]

    def start_whole(self, label: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], names: Sequence[str],
                    compressor: Compressor, backend: Backend, average: bool, traffic: TrafficStats,
                    alone: Callable[[torch.Tensor, str], bool]) -> Pending | None:
        """Send a caller's 1-D bucket ``flat`` (tensors named ``names`` back to back in it, whose
        shapes and dtypes ``tensors`` give) as one tensor of an elementwise ``compressor`` (one
        cast, one allreduce), decoded into ``flat`` itself; ``None`` where ``flat`` is not laid out
        so, or where not every tensor would be sent ``alone`` as this compressor's allreduce
        (decided once per names, dtype and world: what every rank shares). On arrival ``traffic``
        records each tensor as sent alone would. Nothing is looked at for infs and NaNs: the caller
        sends only what delivers them in every rank's result and leaves no state a skipped step
        would undo (``Grace.start_whole``)."""
        if not (flat.dim() == 1 and flat.is_contiguous() and sum(t.numel() for t in tensors) == flat.numel()
                and all(t.dtype == flat.dtype for t in tensors)):
            return None
        world_size = backend.size()
        key = (tuple(names), flat.dtype, world_size)
        if key not in self._whole_rows:
            self._whole_rows[key] = None if not all(map(alone, tensors, names)) else self._rows(
                compressor, tensors, flat.dtype, world_size)
        rows = self._whole_rows[key]
        if rows is None:
            return None
        payload, ctx = compressor.compress(flat, label)
        (part,) = payload
        # The cast is a tensor nobody else holds: a backend that can reduce it in place is given it.
        reduce = backend.allreduce_async if part is flat else \
            getattr(backend, "allreduce_owned_async", backend.allreduce_async)
        handle = reduce(part, f"{label}.r0.0", average)  # the name a one-allreduce bucket's flight gives

        def finish() -> torch.Tensor:
            try:
                reduced = backend.wait(handle)
            except RanksStalled as err:
                raise err.carrying(list(names)) from None
            out = compressor.decompress_flat(reduced, (ctx,), flat)
            if out is None or out.data_ptr() != flat.data_ptr():
                raise RuntimeError(f"{compressor!r} is elementwise but did not decode a flat into its place")
            traffic.record_each(rows, "allreduce")
            return flat

        return Pending(finish, part.numel() * part.element_size())

    @staticmethod
    def _rows(compressor: Compressor, tensors: Sequence[torch.Tensor], dtype: torch.dtype,
              world_size: int) -> list[tuple[int, int, float, float]]:
        """What each tensor sent alone would count: (sent, dense, link, dense link) bytes."""
        wire = compressor.payload_spec(1, dtype)[0][1].itemsize
        return [(sent, dense, ring_allreduce_bytes(sent, world_size), ring_allreduce_bytes(dense, world_size))
                for sent, dense in ((t.numel() * wire, t.numel() * t.element_size()) for t in tensors)]

    def holds_for_step(self, name: str) -> bool:
        """Whether the gradient ``name`` goes in the step's flat (:meth:`hold_for_step`) rather than
        through the bundle's pipeline by itself; a flat itself does not."""
        return self.spans_step and not name.startswith(_STEP_FLAT)

    def hold_for_step(self, tensor: torch.Tensor, name: str, start_flat: StartFlat) -> Pending:
        """Hold the gradient ``tensor`` (its caller leaves it as it is until the step's results are
        asked for); when the first result is asked for, ``start_flat`` starts each flat of the step."""
        if name in self._step_held or self.flat_of.get(name) in self._step_flats:  # its flat is in flight
            raise RuntimeError(f"the gradient of {name!r} was sent twice in one step")
        self._step_held[name] = tensor
        self.flat_of[name] = step_flat_name(tensor.dtype, tensor.device)
        self._start_flat = start_flat
        return Pending(functools.partial(self._step_result, name))

    def _step_result(self, name: str) -> torch.Tensor:
        if name in self._step_held:
            self._start_step_flats()
        flat = self._step_flats[self.flat_of[name]]
        start, shape = flat.places.pop(name)
        result = flat.pending()
        if not flat.places:  # every gradient of this flat has its slice
            del self._step_flats[self.flat_of[name]]
        return result.reshape(-1)[start:start + shape.numel()].view(shape)

    def _start_step_flats(self) -> None:
        held, self._step_held = self._step_held, {}
        start_flat, self._start_flat = self._start_flat, None
        assert start_flat is not None
        members: dict[str, list[str]] = {}
        for name in sorted(held):
            members.setdefault(self.flat_of[name], []).append(name)
        for flat_name, names in members.items():
            places, offset = {}, 0
            for name in names:
                places[name] = (offset, held[name].shape)
                offset += held[name].numel()
            flat = torch.cat([held[name].reshape(-1) for name in names])
            self._step_flats[flat_name] = _StepFlat(start_flat(flat, flat_name), places)

    def unlaunched(self) -> set[str]:
        """The tensors sent this step whose collectives this rank has not launched (their bucket
        still waits for other members or the caller's launch; held for the step's flat, no result
        of the step was asked for yet): waiting for those would never end."""
        return ({parcel.name for parcel in self._held} | {name for entries in self._open.values() for name in entries}
                | set(self._step_held))

    def end_step(self) -> None:
        """The step is over: what of its flats nobody asked for, held or arrived, is not kept."""
        self._step_held.clear()
        self._start_flat = None
        self._step_flats.clear()

    def abandon(self) -> None:
        """Drop what has not taken off: the step was abandoned."""
        self._open.clear()
        self._held.clear()
        self._flights.clear()
        self.end_step()

    def carried_with(self, name: str) -> list[str]:
        """``name`` and the tensors fused with it in its planned bucket."""
        if self.plan is None or name not in self.plan.bucket_of:
            return [name]
        return [name, *(n for n in self.plan.buckets[self.plan.bucket_of[name]] if n != name)]
