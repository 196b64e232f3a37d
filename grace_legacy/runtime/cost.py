"""The byte-cost model: what a rank hands to its collectives for one tensor, predicted exactly from
the compressor's configuration alone, from the same ``payload_spec`` and wire layout that sending
uses (budget matching, the schedules, the dense fallback and the planner rely on it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from grace_legacy.runtime import wire

if TYPE_CHECKING:
    from grace_legacy.core.compressor import Compressor


#: The shape at which Accordion compares the bytes of ``low`` and ``high`` (a 1M-element matrix).
REFERENCE_SHAPE = torch.Size([1024, 1024])


def gather_costs_more(packed_bytes: int, dense_bytes: int, world_size: int) -> bool:
    """Whether gathering ``packed_bytes`` from every rank (``(P - 1) * packed`` received per rank)
    moves at least as much as a ring allreduce of the dense tensor (``2 (P - 1) / P * dense``):
    ``packed >= 2 * dense / P``, or ``packed >= dense`` for ``P <= 2``
    (docs/DESIGN.md#dense-fallback)."""
    # Integers, not dense * (2 / P): a float could round across the boundary.
    if world_size > 2:
        return packed_bytes * world_size >= 2 * dense_bytes
    return packed_bytes >= dense_bytes


def bytes_sent(concrete: Compressor | None, shape: int | Sequence[int], dtype: torch.dtype,
               world_size: int | None = None) -> int:
    """Bytes a rank hands to the backend for one tensor (an element count or a shape) on the
    default route: the dense size when ``concrete`` is ``None``, the raw parts of every round for
    an allreduce, the packed buffer for an allgather. With ``world_size``, a gathered payload
    that the dense fallback would replace (:func:`gather_costs_more`) counts as dense."""
    shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
    dense = shape.numel() * dtype.itemsize
    if concrete is None:
        return dense
    spec = concrete.payload_spec_for(shape, dtype)
    if concrete.traits.additive:
        return sum(n * d.itemsize for n, d in spec)
    packed = wire.packed_size_of(spec, with_header=not concrete.traits.uniform_payload)
    if world_size is not None and concrete.traits.aggregates_by_mean and gather_costs_more(packed, dense, world_size):
        return dense
    return packed


# -- the link ------------------------------------------------------------------------------------
#: The routes a tensor can take. On equal link bytes the earlier one is taken: dense is exact, and
#: a scatter-gather re-compresses at the owner, one more lossy step than a gather.
ROUTES = ("dense", "allreduce", "allgather", "scattergather")


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Link bytes per rank of a bandwidth-optimal allreduce of ``nbytes``: ``2 (P - 1) / P * B``."""
    return 2 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def route_link_bytes(concrete: Compressor | None, shape: int | Sequence[int], dtype: torch.dtype,
                     world_size: int, *, busiest: bool = False) -> dict[str, float]:
    """Link bytes per rank for one tensor on every route it can take (``concrete`` ``None``: dense
    only). Additive payloads are allreduced (``2 (P - 1) / P`` of their raw parts, every round);
    a gathered payload of ``b`` packed bytes costs ``(P - 1) b`` gathered and about
    ``2 (P - 1) / P * b`` scattered and gathered again (an all-to-all of the shards, then the
    owners' re-compressed shards gathered); the dense route ``2 (P - 1) / P`` of the dense bytes.
    A payload whose size the data decides (Threshold) has only its gather, as has a compressor of
    whole tensors only (not ``shardable``: no owner can re-compress a shard); a majority vote no
    dense route (a dense mean would change its update). ``busiest``: the scatter-gather's bytes
    on its busiest link instead of the mean over the ranks (:func:`scatter_gather_bytes`)."""
    shape = torch.Size([shape]) if isinstance(shape, int) else torch.Size(shape)
    dense = shape.numel() * dtype.itemsize
    costs = {"dense": ring_allreduce_bytes(dense, world_size)}
    if concrete is None:
        return costs
    if not concrete.traits.aggregates_by_mean:
        del costs["dense"]
    try:
        spec = concrete.payload_spec_for(shape, dtype)
    except NotImplementedError:  # a size only the data decides: every rank could choose differently
        return {"allgather": float("nan")}
    if concrete.traits.additive:
        raw = sum(n * d.itemsize for n, d in spec)
        return {"allreduce": ring_allreduce_bytes(raw, world_size)}
    packed = wire.packed_size_of(spec, with_header=not concrete.traits.uniform_payload)
    costs["allgather"] = float((world_size - 1) * packed)
    if concrete.traits.rounds == 1 and concrete.traits.shardable:  # its owners compress shards as tensors of their own
        costs["scattergather"] = scatter_gather_bytes(concrete, shape.numel(), dtype, world_size, busiest=busiest)
    return costs


def segment_bytes(concrete: Compressor, numel: int, dtype: torch.dtype) -> tuple[int, int]:
    """The packed bytes of a scatter-gather's two payloads of one ``numel``-element segment: the
    segment compressed by ``concrete``, and its owner's re-encoding (``for_sums``), each with a
    size header where its size is not fixed by the configuration (or the encoder differs)."""
    shape = torch.Size([numel])
    first = wire.packed_size_of(concrete.payload_spec_for(shape, dtype),
                                with_header=not concrete.traits.uniform_payload)
    encoder = concrete.for_sums()
    second = wire.packed_size_of(encoder.payload_spec_for(shape, dtype),
                                 with_header=not concrete.traits.uniform_payload or encoder is not concrete)
    return first, second


def scatter_gather_bytes(concrete: Compressor, numel: int, dtype: torch.dtype, world_size: int, *,
                         busiest: bool = False) -> float:
    """Link bytes per rank (the mean over the ranks) of a scatter-gather of one tensor of ``numel``
    elements cut into ``world_size`` shards: each segment's payload leaves its rank for its owner
    and the owner's payload reaches the other ranks, so ``(P - 1) / P`` of every segment's two
    payloads. Exact for a tensor sent alone; in a bucket a tensor is cut into no more segments.
    ``busiest``: the bytes of the busiest rank's link instead, the owner of the smallest shard
    (it carries every other segment's payloads), which routing compares with dense."""
    if world_size < 2:
        return 0.0
    base, extra = divmod(numel, world_size)
    # ``extra`` segments of ``base + 1`` elements, the others of ``base`` (none where ``base`` is 0).
    larger = sum(segment_bytes(concrete, base + 1, dtype))
    smaller = sum(segment_bytes(concrete, base, dtype)) if base else 0
    total = extra * larger + (world_size - extra) * smaller
    if busiest:  # the owner of a ``base``-element shard (``extra`` < ``world_size``)
        return float(total - smaller)
    return (world_size - 1) / world_size * total


def cheapest_route(costs: dict[str, float]) -> str:
    """The route of least link bytes; on a tie the earlier of :data:`ROUTES`."""
    if len(costs) == 1:
        return next(iter(costs))
    return min(costs, key=lambda route: (costs[route], ROUTES.index(route)))


def choose_route(concrete: Compressor, shape: int | Sequence[int], dtype: torch.dtype, world_size: int, *,
                 forced: str | None = None, dense_fallback: bool = True, byte_optimal: bool = False) -> str:
    """The route a bundle takes for a tensor that ``concrete`` compresses, at ``world_size`` ranks,
    a function of the configuration, the shape and the number of ranks alone, so every rank takes
    the same.

    * ``forced`` (a communicator's route: ``"allreduce"``, ``"allgather"``, ``"broadcast"`` or
      ``"scattergather"``): that route, or ``"dense"`` where sending the tensor uncompressed costs
      no more link bytes.
    * The default (``forced`` ``None``): the route that keeps the compressor's own aggregation,
      an allreduce for an additive payload and a gather of every rank's payload otherwise, or
      ``"dense"`` where that puts no more bytes on the link (dense is exact). Never the
      scatter-gather: its owners re-compress the sum, which is another algorithm.
    * ``byte_optimal`` (``Grace(communicator="auto")``): the fewest link bytes among every route,
      the scatter-gather included from three ranks.

    Link bytes are :func:`route_link_bytes`'s, the scatter-gather's of its busiest rank; one rank
    decides as two. ``dense_fallback`` off: never ``"dense"`` where a compressed route exists."""
    # The busiest link, not the mean: a rank owning a small shard of a small tensor carries more
    # than the mean, and no rank should carry more than a dense allreduce puts on its link.
    costs = route_link_bytes(concrete, shape, dtype, max(world_size, 2), busiest=True)
    if forced is not None and forced != "allreduce":
        via = "scattergather" if forced == "scattergather" else "allgather"
        candidates = {r: c for r, c in costs.items() if r in (via, "dense")}
        candidates.setdefault(via, 0.0)  # a size only the data decides: no choice to make
    else:
        candidates = dict(costs)
        if not byte_optimal or world_size < 3:
            # Two ranks swap halves, as a gather swaps wholes: no fewer bytes but those that
            # rounding per segment drops, for a second lossy step. Taken only when asked for.
            candidates.pop("scattergather", None)
    if not dense_fallback and len(candidates) > 1:
        candidates.pop("dense", None)
    route = cheapest_route(candidates)
    return forced if forced is not None and route != "dense" else route


def link_bytes(concrete: Compressor | None, shape: int | Sequence[int], dtype: torch.dtype, world_size: int, *,
               byte_optimal: bool = False) -> float:
    """Link bytes per rank for one tensor sent alone on the route a bundle with no communicator
    named takes (:func:`choose_route`; ``byte_optimal``: ``Grace(communicator="auto")``'s);
    ``concrete`` ``None``: dense."""
    costs = route_link_bytes(concrete, shape, dtype, world_size)
    if concrete is None:
        return costs["dense"]
    route = choose_route(concrete, shape, dtype, world_size, byte_optimal=byte_optimal)
    return costs[route] if world_size > 1 else float(bytes_sent(concrete, shape, dtype, world_size))
