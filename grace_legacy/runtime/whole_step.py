"""A step's gradients held and started as one tensor, for a compressor that selects over the whole
model at once (:attr:`~grace_legacy.core.compressor.Compressor.spans_step`: ``GlobalTopK``, ``CAT``).

The bundle hands each gradient here instead of compressing it. Nothing is sent until the first
result is asked for: both integrations ask only once every gradient of the step has been started
(``hvd.DistributedOptimizer.synchronize`` starts the ones the backward pass did not; the DDP hook
waits at its last bucket), so at that moment this rank holds the whole step. The held gradients are
then concatenated, one flat per dtype and device, in the order of their names (sorted, so every
rank lays them out alike whatever order they arrived in), and each flat is started once, as one
tensor, under the name :func:`whole_name` gives it: its error feedback, its traffic row and its
collectives are the flat's. Each gradient's result is its slice of the flat's result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grace_legacy.core.backend import Pending

#: Starts one flat under a name and returns its pending result (the bundle's own ``start``).
Launch = Callable[[torch.Tensor, str], Pending]

_PREFIX = "whole-step."


def whole_name(dtype: torch.dtype, device: torch.device) -> str:
    """The name a step's flat of ``dtype`` on ``device`` is compressed and sent under."""
    where = "" if device.type == "cpu" else f".{device}"
    return f"{_PREFIX}{str(dtype).removeprefix('torch.')}{where}"


@dataclass
class _Flight:
    """One flat of the step: its pending result and where each gradient lies in it."""

    pending: Pending
    places: dict[str, tuple[int, torch.Size]]


class WholeStep:
    """The gradients of the step under way, held until the first result is asked for."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}
        self._launch: Launch | None = None
        self._flights: dict[str, _Flight] = {}
        #: each gradient's flat, by name (the same every step: a name keeps its dtype and device)
        self.flat_of: dict[str, str] = {}

    def is_flat(self, name: str) -> bool:
        """Whether ``name`` is a flat's own name (started by this class, not a gradient)."""
        return name.startswith(_PREFIX)

    def hold(self, tensor: torch.Tensor, name: str, launch: Launch) -> Pending:
        """Hold ``tensor`` (the caller will not change it before the step's results are asked
        for); ``launch`` starts a flat when the first result is asked for."""
        if name in self._held or name in self.flat_of and self.flat_of[name] in self._flights:
            raise RuntimeError(f"the gradient of {name!r} was sent twice in one step")
        self._held[name] = tensor
        self.flat_of[name] = whole_name(tensor.dtype, tensor.device)
        self._launch = launch
        return Pending(lambda: self._result_of(name), 0)

    def held(self) -> set[str]:
        """The gradients held and not yet sent (waiting for one of them would send them)."""
        return set(self._held)

    def _result_of(self, name: str) -> torch.Tensor:
        if name in self._held:
            self._send_held()
        flight = self._flights[self.flat_of[name]]
        start, shape = flight.places.pop(name)
        result = flight.pending()
        if not flight.places:  # every gradient of this flat has its slice
            del self._flights[self.flat_of[name]]
        return result.reshape(-1)[start:start + shape.numel()].view(shape)

    def _send_held(self) -> None:
        held, self._held = self._held, {}
        launch, self._launch = self._launch, None
        assert launch is not None
        groups: dict[str, list[str]] = {}
        for name in sorted(held):
            groups.setdefault(self.flat_of[name], []).append(name)
        for flat_name, names in groups.items():
            places, offset = {}, 0
            for name in names:
                places[name] = (offset, held[name].shape)
                offset += held[name].numel()
            flat = torch.cat([held[name].reshape(-1) for name in names])
            self._flights[flat_name] = _Flight(launch(flat, flat_name), places)

    def abandon(self) -> None:
        """Forget the step under way: nothing held is sent, no result is kept."""
        self._held.clear()
        self._launch = None
        self._flights.clear()
