"""The one line a bundle with no communicator named says after its first step, where the route
that keeps the compressor's own aggregation puts far more bytes on the link than the two-phase
route would: the default never changes the algorithm the user named, but the user should know
what it costs, and which argument changes it."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from grace_legacy.runtime.cost import ring_allreduce_bytes, route_link_bytes

if TYPE_CHECKING:
    from grace_legacy.core.compressor import Compressor

#: How many times the two-phase route's link bytes a tensor's default route may put on the link
#: before it counts as far costlier (gathered payloads from eight ranks on, about).
ADVICE_FACTOR = 4
logger = logging.getLogger("grace_legacy")


class RouteAdvice:
    """The first step's link bytes per rank on the default routes (the cost model's, per tensor
    sent alone): in all, and where the two-phase route would move at least :data:`ADVICE_FACTOR`
    times fewer or compress what the default sends dense, with that route's bytes beside them."""

    def __init__(self) -> None:
        self.total = 0.0
        self.costly = 0.0
        self.two_phase = 0.0

    def weigh(self, concrete: Compressor | None, tensor: torch.Tensor, route: str, world_size: int) -> None:
        """Count ``tensor``, sent by ``route`` (``concrete`` ``None``: uncompressed)."""
        dense = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), world_size)
        if concrete is None:
            self.total += dense
            return
        costs = route_link_bytes(concrete, tensor.shape, tensor.dtype, world_size)
        spent = dense if route == "dense" else costs.get(route, dense)
        if math.isnan(spent):  # a size only the data decides: no two-phase route to compare with
            return
        self.total += spent
        two_phase = costs.get("scattergather")
        if world_size < 3 or two_phase is None:
            return
        if spent >= ADVICE_FACTOR * two_phase or (route == "dense" and two_phase < dense):
            self.costly += spent
            self.two_phase += two_phase

    def message(self, compressor: Any, world_size: int) -> str | None:
        """The line to log, or ``None`` where no tensor's default route was far costlier."""
        if not self.costly:
            return None
        return (f"grace_legacy: at {world_size} workers, {self.costly / self.total:.0%} of this step's link "
                f"bytes carry {compressor!r} by the route of its own aggregation (each rank's payload gathered, "
                f"or dense), {self.costly / self.two_phase:.1f}x what the two-phase route would put on the "
                f"link; Grace(..., communicator='auto') takes the route of fewest bytes, whose owners "
                f"re-compress each shard's sum (a different algorithm)")

    def give(self, compressor: Any, rank: int, world_size: int) -> None:
        """Log :meth:`message` on rank 0."""
        line = self.message(compressor, world_size)
        if line is not None and rank == 0:
            logger.warning(line)
