"""Deep Gradient Compression's memory: momentum correction, factor masking, local clipping."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.journal import StepJournal
from grace_legacy.core.knob import Knob
from grace_legacy.core.memory import Memory
from grace_legacy.core.validation import ArgumentTypeError, checked_knob_value

MOMENTUM = Knob("momentum", low=0.0, high=1.0, high_inclusive=False)


class DGCMemory(Memory):
    """Momentum correction and local gradient clipping (Lin et al., ICLR 2018, sec. 3.2) and
    momentum factor masking (sec. 3.3).

    Per tensor, with ``u`` the local momentum and ``v`` the local accumulation (both start at 0)
    and ``m = momentum``:

        g  <- clip(g)                  (only with ``clip``; see below)
        u  <- m * u + g                momentum correction: accumulate the *velocity*, not g
        v  <- v + u
        send C(v)
        u[S] <- 0,  v[S] <- 0          factor masking, S = the entries C(v) carried

    so an entry's momentum restarts once it has been sent, instead of pushing stale velocity
    into later steps. Momentum lives here: run the optimizer **without** momentum (plain SGD),
    as DGC does. When a tensor is sent dense (density 1.0, a LEGACY ``None``), every entry was
    sent and both ``u`` and ``v`` restart at 0.

    ``S`` comes from the compressor's ``support(payload, ctx)`` (the flat indices its payload
    carries): DGC, TopK, RandomK and Threshold have one. A compressor without one cannot be
    masked, and :meth:`update` refuses it with a ``TypeError``.

    ``clip``: local gradient clipping (sec. 3.2): this rank's gradient is scaled by
    ``min(1, clip / ||g||_2)`` *before* it is added to ``u``, so accumulation over many steps
    cannot blow up a single entry. The norm is the L2 norm of this one tensor (computed in fp32
    at least), because a memory sees one gradient at a time while the backward pass is still
    running; the paper clips the whole model's norm with the global threshold scaled by
    ``N ** -0.5`` for ``N`` ranks, so a per-tensor bound should be chosen with that in mind.

    ``u`` and ``v`` are kept in the gradient's dtype; :meth:`state_dict` saves both.
    """

    def __init__(self, momentum: float = 0.9, clip: float | None = None) -> None:
        if momentum is None:  # Knob.check lets None through (a knob's "dense"); here it is a mistake
            raise ArgumentTypeError(f"DGCMemory: momentum must be {MOMENTUM.describe_range()}, got None")
        self.momentum = float(checked_knob_value(MOMENTUM, momentum, "DGCMemory"))
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
        self._journal = StepJournal()

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
        # Out of place throughout: what compensate returns may already be on the wire (a dense
        # allreduce in flight) when update runs, so no tensor handed out is ever written again.
        u = u * self.momentum + self.clipped(tensor)
        v = v + u
        self._journal.remember(self.velocities, name)
        self._journal.remember(self.accumulations, name)
        self.velocities[name] = u
        self.accumulations[name] = v
        return v

    def update(self, compensated: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        if compressor.lossless:
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
        if not compressor.sparsifies:
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
