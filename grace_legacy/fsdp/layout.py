"""Where FSDP2 puts each parameter's gradient in the flat input of a unit's reduce-scatter.

``foreach_reduce`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) copies a unit's
unsharded gradients into one flat buffer viewed as ``(P, -1)``: row ``r`` is the shard that rank
``r`` receives, and holds, parameter after parameter in the unit's order, the ``r``-th chunk of
each gradient. A gradient of ``n`` rows (its first dimension; a parameter sharded on dimension
``d > 0`` is first cut into ``P`` chunks along ``d`` that are stacked along dimension 0) is padded
with zero rows to ``c P`` rows, ``c = ceil(n / P)``, and chunk ``r`` is rows ``[r c, (r + 1) c)``:
``min(c, max(0, n - r c))`` real rows, then padding. So the segment of parameter ``i`` for owner
``r`` is one contiguous run of row ``r``, and every rank knows every segment's shape from the
unit's parameter shapes alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch


class Piece(NamedTuple):
    """One parameter's part of every shard: ``rows`` rows of ``row_elements`` elements each, from
    element ``offset`` of a shard row; ``shape`` is the gradient as FSDP lays it out along
    dimension 0 (``shape[0]`` real rows in all)."""

    name: str
    shape: torch.Size
    rows: int
    row_elements: int
    offset: int

    @property
    def width(self) -> int:
        """Elements of each shard row this parameter takes, padding included."""
        return self.rows * self.row_elements

    def real_rows(self, owner: int) -> int:
        """How many of owner ``owner``'s rows are the gradient's (the rest are padding)."""
        return min(self.rows, max(0, self.shape[0] - owner * self.rows))

    def segment_shape(self, owner: int) -> torch.Size:
        return torch.Size([self.real_rows(owner), *self.shape[1:]])

    def span(self, owner: int) -> tuple[int, int]:
        """``[start, stop)`` of owner ``owner``'s segment among the gradient's flattened elements."""
        start = owner * self.width
        return start, start + self.real_rows(owner) * self.row_elements

    @property
    def numel(self) -> int:
        return self.shape.numel()


def dim0_shape(shape: Sequence[int], shard_dim: int, world_size: int) -> torch.Size:
    """The shape FSDP reduce-scatters a gradient of ``shape`` sharded on ``shard_dim`` in: the
    ``world_size`` chunks along ``shard_dim`` stacked along dimension 0 (``shape`` itself for 0)."""
    shape = torch.Size(shape)
    if shard_dim == 0 or world_size == 1 or len(shape) == 0:
        return shape
    if shape[shard_dim] % world_size:
        raise ValueError(f"a gradient of shape {tuple(shape)} sharded on dimension {shard_dim} must divide evenly "
                         f"among {world_size} ranks (FSDP requires it too)")
    out = list(shape)
    out[shard_dim] //= world_size
    out[0] *= world_size
    return torch.Size(out)


def unit_pieces(parameters: Sequence[tuple[str, torch.Size]], world_size: int) -> tuple[list[Piece], int]:
    """The pieces of a unit whose reduce-scattered parameters are ``(name, dim-0 shape)`` in FSDP's
    order, and the number of elements of one shard."""
    pieces, offset = [], 0
    for name, shape in parameters:
        shape = torch.Size(shape) if len(shape) else torch.Size([1])
        rows = math.ceil(shape[0] / world_size)
        row_elements = math.prod(shape[1:])
        pieces.append(Piece(name, torch.Size(shape), rows, row_elements, offset))
        offset += rows * row_elements
    return pieces, offset
