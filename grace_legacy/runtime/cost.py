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
    dense = shape.numel() * torch.empty((), dtype=dtype).element_size()
    if concrete is None:
        return dense
    spec = concrete.payload_spec_for(shape, dtype)
    if concrete.additive:
        return sum(n * torch.empty((), dtype=d).element_size() for n, d in spec)
    packed = wire.packed_size_of(spec, with_header=not concrete.uniform_payload)
    if world_size is not None and concrete.aggregates_by_mean and gather_costs_more(packed, dense, world_size):
        return dense
    return packed
