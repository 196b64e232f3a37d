"""Deep Gradient Compression's memory: momentum correction, factor masking, local clipping."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.state import UndoLog
from grace_legacy.runtime.validation import ArgumentTypeError, checked_value

MOMENTUM = ScheduledParameter("momentum", low=0.0, high=1.0, high_inclusive=False)


class DGCMemory(Memory):
    """Momentum correction, local gradient clipping (Lin et al., ICLR 2018, sec. 3.2) and momentum
    factor masking (sec. 3.3). Per tensor, with ``u`` the local momentum and ``v`` the local
    accumulation (both from 0, in the gradient's dtype) and ``m = momentum``:

        g  <- g * min(1, clip / ||g||_2)   (only with ``clip``)
        u  <- m * u + g                    momentum correction: accumulate the velocity
        v  <- v + u
        send C(v)
        u[S] <- 0,  v[S] <- 0              factor masking, S = the entries C(v) carried

    Momentum lives here: run the optimizer without it (plain SGD), as DGC does. A tensor sent dense
    restarts both at 0. ``S`` is the compressor's ``support`` (a sparsifier's; others are refused
    with ``ValueError``). ``clip`` bounds this one tensor's norm (in fp32 at least), where the paper
    clips the whole model's with the global bound scaled by ``N ** -0.5`` for ``N`` ranks."""

    def __init__(self, momentum: float = 0.9, clip: float | None = None) -> None:
        if momentum is None:  # ScheduledParameter.check lets None through (a parameter's "dense"); here it is a mistake
            raise ArgumentTypeError(f"DGCMemory: momentum must be {MOMENTUM.describe_range()}, got None")
        self.momentum = float(checked_value(MOMENTUM, momentum, "DGCMemory"))
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, numbers.Real) or isinstance(clip, torch.Tensor):
                raise ArgumentTypeError(f"DGCMemory: clip must be None or a finite number > 0, got {clip!r} "
                                        f"of type {type(clip).__name__}")
            try:
                norm = float(clip)
            except OverflowError:  # an int beyond a float's range
                norm = math.inf
            if not math.isfinite(norm) or norm <= 0:
                raise ValueError(f"DGCMemory: clip must be None or a finite number > 0, got {clip!r}")
            clip = norm
        self.clip = clip
        self.velocities: dict[str, torch.Tensor] = {}
        self.accumulations: dict[str, torch.Tensor] = {}
        self.undo_log = UndoLog()

    def clipped(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor * min(1, clip / ||tensor||_2)``; the tensor itself without ``clip``."""
        if self.clip is None:
            return tensor
        norm = torch.linalg.vector_norm(tensor, dtype=torch.promote_types(tensor.dtype, torch.float32))
        return tensor * (self.clip / norm).clamp(max=1.0).to(tensor.dtype)

    def _state(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.velocities.get(name)
        if u is None:
            zeros = torch.zeros_like(tensor)
            return zeros, zeros
        if u.shape != tensor.shape or u.dtype != tensor.dtype:
            raise ValueError(f"DGCMemory: tensor {name!r} changed from {tuple(u.shape)} {u.dtype} "
                             f"to {tuple(tensor.shape)} {tensor.dtype}")
        return u, self.accumulations[name]

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        u, v = self._state(tensor, name)
        # Out of place: what compensate returns may be on the wire (a dense allreduce) when update runs.
        u = u * self.momentum + self.clipped(tensor)
        v = v + u
        self.undo_log.remember(self.velocities, name)
        self.undo_log.remember(self.accumulations, name)
        self.velocities[name] = u
        self.accumulations[name] = v
        return v

    def update(self, compensated: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        if compressor.traits.lossless:
            self.velocities.pop(name, None)
            self.accumulations.pop(name, None)
            return
        sent = compressor.support(payload, ctx).to(device=compensated.device, dtype=torch.long)
        mask = torch.zeros(compensated.numel(), dtype=torch.bool, device=compensated.device)
        mask[sent] = True
        mask = mask.view(compensated.shape)
        self.velocities[name] = self.velocities[name].masked_fill(mask, 0)
        self.accumulations[name] = self.accumulations[name].masked_fill(mask, 0)

    def check_compressor(self, compressor: Compressor) -> None:
        if not compressor.traits.sends_entries:
            raise ValueError(f"DGCMemory masks the entries a payload carried, but {compressor!r} sends no subset of "
                             f"entries; use a sparsifier (DGC, TopK, RandomK, Threshold) or another memory")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "velocities": {name: u.detach().clone() for name, u in self.velocities.items()},
                "accumulations": {name: v.detach().clone() for name, v in self.accumulations.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocities = {name: u.clone() for name, u in state["velocities"].items()}
        self.accumulations = {name: v.clone() for name, v in state["accumulations"].items()}

    def __repr__(self) -> str:
        return f"DGCMemory(momentum={self.momentum:g}, clip={self.clip!r})"
