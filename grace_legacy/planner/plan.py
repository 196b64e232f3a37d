"""What a compression set-up will put on the links, before training: per phase and size group, the
tensors, their elements, the parameter value, the routes a :class:`~grace_legacy.Grace` bundle takes
at a number of workers, the link bytes per step against a dense ring allreduce's, and the wire
volume over the run.

**Link bytes** are :mod:`grace_legacy.runtime.traffic`'s: what the collectives put on one rank's
link with bandwidth-optimal algorithms. For ``P`` workers and one tensor of ``D`` dense bytes:

* ``dense`` (and ``dense-fallback``): a ring allreduce, ``2 (P - 1) / P * D``;
* ``allreduce`` (an additive payload): ``2 (P - 1) / P`` times each round's raw bytes;
* ``allgather``: the other ranks' packed payloads, ``(P - 1) * b``;
* ``scattergather``: the tensor's segments (its parts in the shards of its fused bucket,
  :func:`~grace_legacy.communicators.scatter_gather.segments_of`, here in the closed form of
  :func:`segment_runs`) each leave for their owner and the owner's re-encoded payload comes back:
  rank ``r`` carries both payloads of every segment it does not own, the mean over the ranks
  ``(P - 1) / P`` of the segments' payloads.

The route of each tensor is :func:`~grace_legacy.runtime.cost.choose_route`'s, the function the
bundle calls (with no communicator named: the route of the compressor's own aggregation; with
``route="auto"``: the fewest link bytes, two-phase included, as ``Grace(communicator="auto")``);
the fused buckets are the bundle's :class:`~grace_legacy.communicators.fusion.BucketPlan`
over the tensors in reverse registration order (the order the optimizer and the DDP hook plan them),
``default_bucket_bytes()`` unless told. So the planned link bytes of rank ``r`` per step,
:meth:`Plan.rank_link_bytes`, are what that rank's bundle's ``stats["wire_bytes"]`` records for
the step, bit for bit when the tensors finish in arrival order, and :attr:`Plan.volume` is
``stats["volume"]`` over the run (with one worker nothing crosses a link and, as in the stats, the
volume is the ratio of the bytes handed to the collectives to the dense bytes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from grace_legacy.communicators.fusion import BucketPlan, checked_bucket_bytes
from grace_legacy.core.compressor import Compressor, Tunable
from grace_legacy.runtime import wire
from grace_legacy.runtime.cost import choose_route, ring_allreduce_bytes, segment_bytes
from grace_legacy.runtime.validation import (
    MAX_NUMEL,
    ArgumentTypeError,
    check_flag,
    check_gradient_dtype,
    check_positive_int,
    checked_shapes,
)
from grace_legacy.schedules.legacy import Legacy

#: The number of workers a plan is made for when none is given.
DEFAULT_WORKERS = 4
#: The worker counts of the scaling table.
WORKER_COUNTS = (4, 8, 16, 64, 256, 1024)
#: What ``route=`` may force: every tensor dense, or the route of a communicator
#: (``Grace(communicator=Allreduce() / Allgather() / ScatterGather())``).
FORCED_ROUTES = ("dense", "allreduce", "allgather", "scattergather")
#: The byte-optimal choice per tensor (``Grace(communicator="auto")``), which ``route=`` may ask for too.
AUTO = "auto"


@dataclass(frozen=True)
class TensorPlan:
    """One tensor in one phase: the route the bundle takes (as ``stats["tensors_by_route"]`` names
    it) and what it hands to the collectives and puts on the links per step."""

    #: the tensor's position among the shapes given
    index: int
    phase: int
    group: int
    numel: int
    route: str
    #: bytes handed to the collectives and link bytes per rank, the means over the ranks
    bytes_sent: float
    link_bytes: float
    bytes_dense: int
    link_dense: float
    #: scatter-gather only: its segments as runs ``(first owner, last owner + 1, payload bytes,
    #: owner's payload bytes)`` of consecutive owners holding segments of one size
    segments: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def segment_count(self) -> int:
        return sum(stop - start for start, stop, _, _ in self.segments)

    def _owned(self, rank: int) -> tuple[int, int]:
        """The two payloads' bytes of this tensor's segment owned by ``rank`` (0 if none)."""
        for start, stop, first, second in self.segments:
            if start <= rank < stop:
                return first, second
        return 0, 0

    def link_bytes_of(self, rank: int) -> float:
        """Link bytes of rank ``rank``: the same on every rank, except for a scatter-gather (no
        byte of the segment it owns crosses its link)."""
        if self.route != "scattergather":
            return self.link_bytes
        total = sum((stop - start) * (first + second) for start, stop, first, second in self.segments)
        return float(total - sum(self._owned(rank)))

    def bytes_sent_of(self, rank: int) -> float:
        """Bytes rank ``rank`` hands to the collectives (a scatter-gather: every segment's payload,
        and the owner's payload of the segment it owns)."""
        if self.route != "scattergather":
            return self.bytes_sent
        return float(sum((stop - start) * first for start, stop, first, _ in self.segments) + self._owned(rank)[1])


@dataclass(frozen=True)
class Cell:
    """One phase x size group: its tensors' routes and what they put on the links per step."""

    phase: int
    group: int
    tensors: int
    elements: int
    parameter: Any
    #: (route, tensors) pairs, the bundle's routes
    routes: tuple[tuple[str, int], ...]
    link_bytes: float
    link_dense: float
    bytes_sent: float
    bytes_dense: int

    @property
    def fallback(self) -> int:
        """Tensors the dense fallback sends dense although the parameter compresses them."""
        return dict(self.routes).get("dense-fallback", 0)

    @property
    def volume(self) -> float:
        if self.link_dense:
            return self.link_bytes / self.link_dense
        return self.bytes_sent / self.bytes_dense if self.bytes_dense else 0.0


@dataclass(frozen=True)
class Plan:
    """Every cell of a set-up at :attr:`world_size` workers, every tensor's route per phase, the
    phases' shares of the run, and the run's expected wire volume."""

    cells: list[Cell]
    phase_weights: list[float]
    group_labels: list[str]
    phase_labels: list[str]
    parameter_name: str
    world_size: int
    bucket_bytes: int
    #: per phase, the tensors in arrival order (reverse registration order)
    tensors: list[list[TensorPlan]] = field(repr=False)
    #: per phase, how many collectives of each kind a step runs
    collectives: list[dict[str, int]] = field(repr=False)

    def phase_totals(self, phase: int) -> tuple[float, float]:
        """(link bytes, a dense ring allreduce's link bytes) per step and rank in ``phase``; with one
        worker (nothing on a link) the bytes handed to the collectives and the dense bytes."""
        tensors = self.tensors[phase]
        if self.world_size == 1:
            return sum(t.bytes_sent for t in tensors), sum(t.bytes_dense for t in tensors)
        return sum(t.link_bytes for t in tensors), sum(t.link_dense for t in tensors)

    @property
    def volume(self) -> float:
        """Link bytes over the run against a dense ring allreduce's: each phase's bytes per step
        weighted by its share of the run."""
        sent = sum(w * self.phase_totals(p)[0] for p, w in enumerate(self.phase_weights))
        dense = self.phase_totals(0)[1]
        return sent / dense if dense else 0.0

    def rank_link_bytes(self, rank: int, phase: int = 0) -> float:
        """Rank ``rank``'s link bytes in one step of ``phase``, summed in arrival order as the
        bundle's ``stats["wire_bytes"]`` sums them when the tensors finish in that order."""
        total = 0.0
        for tensor in self.tensors[phase]:
            total += tensor.link_bytes_of(rank)
        return total

    def rank_link_dense(self, phase: int = 0) -> float:
        """A dense ring allreduce's link bytes in one step, summed as ``stats["wire_dense"]``."""
        total = 0.0
        for tensor in self.tensors[phase]:
            total += tensor.link_dense
        return total

    def rank_bytes_sent(self, rank: int, phase: int = 0) -> int:
        """The bytes rank ``rank`` hands to the collectives in one step (``stats["bytes_sent"]``)."""
        return round(sum(tensor.bytes_sent_of(rank) for tensor in self.tensors[phase]))

    def routes(self, phase: int = 0) -> dict[str, int]:
        """Tensors per route in ``phase`` (``stats["tensors_by_route"]`` after one step)."""
        return dict(Counter(t.route for t in self.tensors[phase]))

    def route_mix(self) -> str:
        """The routes as text, e.g. ``dense 53, scattergather 108``; phases apart by `` | ``."""
        mixes = [", ".join(f"{route} {count}" for route, count in sorted(self.routes(p).items()))
                 for p in range(len(self.tensors))]
        return mixes[0] if len(set(mixes)) == 1 else " | ".join(mixes)


def _group_labels(splits: Sequence[int]) -> list[str]:
    if not splits:
        return ["all"]
    edges = [None, *splits, None]
    return [f"< {hi:,}" if lo is None else (f">= {lo:,}" if hi is None else f"{lo:,} - {hi - 1:,}")
            for lo, hi in zip(edges, edges[1:], strict=False)]


def _phase_labels(schedule: Legacy | None) -> list[str]:
    if schedule is None or schedule.phases == 1:
        return ["all"]
    if schedule.boundaries is not None:
        edges: list[Any] = [0, *schedule.boundaries, schedule.epochs]
    else:
        edges = [Fraction(schedule.epochs * p, schedule.phases) for p in range(schedule.phases + 1)]

    def show(e: Any) -> str:
        if e is None:
            return "end"
        try:
            return f"{float(e):g}"
        except OverflowError:  # an epoch count beyond a float's range: its leading digits
            digits = str(round(e))
            return f"{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
    return [f"epochs {show(a)} - {show(b)}" for a, b in zip(edges, edges[1:], strict=False)]


# -- one phase ---------------------------------------------------------------------------------

def _nbytes(spec: Sequence[tuple[int, torch.dtype]]) -> int:
    return sum(n * torch.empty((), dtype=d).element_size() for n, d in spec)


def _rounds_of(concrete: Compressor, spec: list[tuple[int, torch.dtype]]) -> list[list[tuple[int, torch.dtype]]]:
    """The payload parts of each allreduce round: ``payload_spec`` lists every round's parts in
    turn (docs/IMPLEMENTING.md), the same number per round."""
    rounds = concrete.traits.rounds
    if rounds == 1:
        return [spec]
    if len(spec) % rounds:
        raise NotImplementedError(f"{concrete!r}: {len(spec)} payload parts do not divide into {rounds} rounds")
    per = len(spec) // rounds
    return [spec[i * per:(i + 1) * per] for i in range(rounds)]


def segment_runs(sizes: Sequence[int], world_size: int) -> list[list[tuple[int, int, int]]]:
    """:func:`~grace_legacy.communicators.scatter_gather.segments_of` in closed form, so that any
    number of workers costs the same: per tensor of ``sizes``, runs ``(first owner, last owner + 1,
    segment elements)`` of consecutive owners each holding one segment of it, in the order of its
    segments. Shard ``j`` starts at ``j * base + min(j, extra)`` and holds ``base + 1`` elements if
    ``j < extra``, else ``base`` (``base, extra = divmod(total, P)``)."""
    base, extra = divmod(sum(sizes), world_size)
    wide = extra * (base + 1)  # elements in the shards of base + 1

    def start(j: int) -> int:
        return j * base + min(j, extra)

    def owner(x: int) -> int:
        return x // (base + 1) if x < wide else extra + (x - wide) // base

    out, offset = [], 0
    for size in sizes:
        runs: list[tuple[int, int, int]] = []
        if size:
            first, last = owner(offset), owner(offset + size - 1)
            if first == last:
                runs.append((first, first + 1, size))
            else:
                runs.append((first, first + 1, start(first + 1) - offset))
                if first + 1 < min(last, extra):
                    runs.append((first + 1, min(last, extra), base + 1))
                if max(first + 1, extra) < last:
                    runs.append((max(first + 1, extra), last, base))
                runs.append((last, last + 1, offset + size - start(last)))
        out.append(runs)
        offset += size
    return out


@dataclass
class _Member:
    """A tensor of the phase being planned: what the bundle decides for it."""

    index: int
    shape: torch.Size
    group: int
    concrete: Compressor | None
    route: str                       # choose_route's (or "dense"), before the bundle's labels
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)


def _plan_phase(members: list[_Member], world_size: int, dtype: torch.dtype, element: int, fused: bool,
                bucket_bytes: int, phase: int) -> tuple[list[TensorPlan], dict[str, int]]:
    """Every member's bytes (``members`` in arrival order) and the step's collectives."""
    if fused:
        buckets = BucketPlan([(str(m.index), m.shape.numel() * element) for m in members], bucket_bytes).buckets
        by_index = {m.index: m for m in members}
        flights = [[by_index[int(name)] for name in bucket] for bucket in buckets]
    else:
        flights = [[m] for m in members]
    collectives: Counter[str] = Counter()
    sizes: dict[tuple[int, int], tuple[int, int]] = {}  # (member, segment numel) -> its two payloads' bytes
    for flight in flights:
        sharded = [m for m in flight if m.route == "scattergather"]
        for member, runs in zip(sharded, segment_runs([m.shape.numel() for m in sharded], world_size), strict=True):
            for start, stop, numel in runs:
                key = (id(member.concrete), numel)
                if key not in sizes:
                    sizes[key] = segment_bytes(member.concrete, numel, dtype)
                member.segments.append((start, stop, *sizes[key]))
        if sharded:
            collectives["alltoall"] += 1
            collectives["allgather"] += 1
        if any(m.route == "allgather" for m in flight):
            collectives["allgather"] += 1
        # One allreduce per dtype and round of the summed parcels (a dense one sends its gradient).
        reduced: set[tuple[int, torch.dtype]] = set()
        for m in flight:
            if m.route == "dense":
                reduced.add((0, dtype))
            elif m.route == "allreduce":
                spec = m.concrete.payload_spec_for(m.shape, dtype)
                reduced.update((r, d) for r, parts in enumerate(_rounds_of(m.concrete, spec)) for _, d in parts)
        collectives["allreduce"] += len(reduced)
    out = []
    for m in members:
        dense = m.shape.numel() * element
        link_dense = ring_allreduce_bytes(dense, world_size)
        segments: tuple[tuple[int, int, int], ...] = ()
        if m.route == "dense":
            sent, link = float(dense), link_dense
        elif m.route == "allreduce":
            rounds = [_nbytes(parts) for parts in _rounds_of(m.concrete, m.concrete.payload_spec_for(m.shape, dtype))]
            sent, link = float(sum(rounds)), 0.0
            for raw in rounds:  # summed round by round, as the exchange counts them
                link += ring_allreduce_bytes(raw, world_size)
        elif m.route == "allgather":
            packed = wire.packed_size_of(m.concrete.payload_spec_for(m.shape, dtype),
                                         with_header=not m.concrete.traits.uniform_payload)
            sent, link = float(packed), float((world_size - 1) * packed)
        else:
            segments = tuple(m.segments)
            firsts = sum((stop - start) * first for start, stop, first, _ in segments)
            seconds = sum((stop - start) * second for start, stop, _, second in segments)
            sent = firsts + seconds / world_size
            link = (world_size - 1) * (firsts + seconds) / world_size
        label = "dense-fallback" if m.route == "dense" and m.concrete is not None else m.route
        out.append(TensorPlan(m.index, phase, m.group, m.shape.numel(), label, sent, link, dense, link_dense,
                              segments))
    return out, dict(collectives)


def plan(compression: Compressor, shapes: Iterable[Any], *, world_size: int | None = None,
         dtype: torch.dtype = torch.float32, bucket_bytes: int | None = None, route: str | None = None,
         dense_fallback: bool = True) -> Plan:
    """The plan of ``compression`` (a compressor with its parameter, or a :class:`Legacy` schedule)
    over tensors ``shapes`` in registration order (element counts, shapes, or (name, shape or
    tensor) pairs such as ``model.named_parameters()``), run by ``Grace(compression)`` at
    ``world_size`` workers (an integer in ``[1, 2**63 - 1]``; ``None``: :data:`DEFAULT_WORKERS`).
    A compressor that spans the step (``GlobalTopK``) is planned on the tensors laid end to end.

    ``bucket_bytes``: the bundle's fused buckets (``None``: ``default_bucket_bytes()``, as
    ``Grace``; ``0``: every tensor alone). ``route``: one of :data:`FORCED_ROUTES` for every
    tensor the compressor compresses, as ``Grace(communicator=...)`` forces it (``"dense"``:
    everything dense); ``None``: the default bundle's routes, those of the compressor's own
    aggregation; ``"auto"``: the fewest link bytes per tensor, as ``Grace(communicator="auto")``;
    ``dense_fallback`` as ``Grace``'s. A payload whose size only the data decides (Threshold) cannot be planned
    (``NotImplementedError``)."""
    if not isinstance(compression, Compressor):
        raise ArgumentTypeError(f"plan: compression must be a grace_legacy compressor or Legacy schedule, got "
                                f"{type(compression).__name__}")
    # Bounded as --workers is: link bytes of (P - 1) gathered payloads must fit a float.
    world_size = DEFAULT_WORKERS if world_size is None else check_positive_int(world_size, "world_size", "plan",
                                                                               high=MAX_NUMEL)
    dtype = check_gradient_dtype(dtype, "dtype", "plan")
    bucket_bytes = checked_bucket_bytes(bucket_bytes, "plan")
    if route is not None and route not in (*FORCED_ROUTES, AUTO):
        raise ValueError(f"plan: route must be None, {AUTO!r} or one of {', '.join(FORCED_ROUTES)}, got {route!r}")
    dense_fallback = check_flag(dense_fallback, "dense_fallback", "plan")
    shapes = checked_shapes(shapes, "shapes", "plan")
    if not any(s.numel() for s in shapes):  # empty tensors send nothing
        raise ValueError("plan: no tensor with elements to plan for")
    # A compressor that spans the step gets its tensors end to end, as one (communicators/fusion.py).
    if compression.traits.spans_step:
        shapes = [torch.Size([sum(s.numel() for s in shapes)])]
    schedule = compression if isinstance(compression, Legacy) else None
    if schedule is None and isinstance(compression, Tunable):
        compression.check_ready()
    if route == "allreduce" and not compression.traits.additive:
        raise ValueError(f"plan: route 'allreduce' sums payloads, but {compression!r} sends a non-additive payload")
    if route in ("allgather", "scattergather") and compression.traits.rounds != 1:
        raise ValueError(f"plan: route {route!r} cannot carry {compression!r}, which needs {compression.traits.rounds} "
                         f"allreduce rounds")
    parameter = compression.parameter
    element = torch.empty((), dtype=dtype).element_size()
    groups = len(schedule.splits) + 1 if schedule else 1
    phases = schedule.phases if schedule else 1
    # Arrival order: the optimizer and the DDP hook plan the buckets over the reversed parameters.
    arrival = [i for i in reversed(range(len(shapes))) if shapes[i].numel()]
    fused = bucket_bytes > 0
    tensors, collectives, cells = [], [], []
    for phase in range(phases):
        members = []
        for i in arrival:
            shape = shapes[i]
            group = schedule.group_of(shape.numel()) if schedule else 0
            configured = schedule.configured_at(phase, group) if schedule else compression
            # compressor_for sees the shape only (PowerSGD sends a 1-D tensor dense): a meta tensor
            # without storage stands for the gradient.
            like = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device="meta")
            concrete = None if configured is None else configured.compressor_for(like, str(i))
            if concrete is None or route == "dense":
                chosen = "dense"
            else:
                chosen = choose_route(concrete, shape, dtype, world_size, forced=None if route == AUTO else route,
                                      dense_fallback=dense_fallback, byte_optimal=route == AUTO)
            members.append(_Member(i, shape, group, concrete, chosen))
        planned, counts = _plan_phase(members, world_size, dtype, element, fused, bucket_bytes, phase)
        tensors.append(planned)
        collectives.append(counts)
        for group in range(groups):
            inside = [t for t in planned if t.group == group]
            if schedule is not None:
                value = schedule.table[phase][group]
            else:
                value = compression.value if parameter else None
            cells.append(Cell(phase, group, len(inside), sum(t.numel for t in inside), value,
                              tuple(sorted(Counter(t.route for t in inside).items())),
                              sum(t.link_bytes for t in inside), sum(t.link_dense for t in inside),
                              sum(t.bytes_sent for t in inside), sum(t.bytes_dense for t in inside)))
    return Plan(cells, schedule.phase_weights() if schedule else [1.0],
                _group_labels(schedule.splits if schedule else []), _phase_labels(schedule),
                parameter.name if parameter else "-", world_size, bucket_bytes, tensors, collectives)
