"""EF21: error feedback by compressing the change of each rank's gradient estimate."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory
from grace_legacy.core.state import UndoLog


class EF21(Memory):
    """EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021), per tensor. Rank ``i`` keeps ``g_i``,
    its estimate of its own gradient, and every rank the same ``g``, the estimate of the
    synchronized gradient (both from 0, in the gradient's dtype):

        sent_i = C(grad_i - g_i)                 compensate
        g_i   <- g_i + D(sent_i)                 update
        g     <- g + op_r D(sent_r)              aggregated; g is applied

    ``op_r`` is the communicator's mean (``hvd.Average``) or sum (``hvd.Sum``), and by induction
    ``g == op_r g_i`` up to rounding, so the op must stay the same for the whole run. The first step
    sends ``C(grad_i)`` (the paper's ``g_i^0``); a dense step resynchronizes both. Any compressor
    runs; the theory asks for a contractive one, ``||D(C(x)) - x||^2 <= (1 - a) ||x||^2`` with
    ``a > 0`` (Top-k, DGC: ``a = k / n``; not Threshold)."""

    # g is a mean over the world that was: every rank restarts from zero when ranks change.
    survives_world_change = False

    def __init__(self) -> None:
        self.local: dict[str, torch.Tensor] = {}
        self.estimates: dict[str, torch.Tensor] = {}
        self.undo_log = UndoLog()

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        local = self.local.get(name)
        if local is None:
            return tensor
        if local.shape != tensor.shape or local.dtype != tensor.dtype:
            raise ValueError(f"EF21: tensor {name!r} changed from {tuple(local.shape)} {local.dtype} "
                             f"to {tuple(tensor.shape)} {tensor.dtype}")
        return tensor - local

    def update(self, compensated: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        sent = compressor.decompress(payload, ctx)
        local = self.local.get(name)
        self.undo_log.remember(self.local, name)
        # Out of place, a copy the first time: the decoded payload may be a view of the wire's buffer.
        self.local[name] = sent.clone() if local is None else local + sent

    def aggregated(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        estimate = self.estimates.get(name)
        estimate = tensor.clone() if estimate is None else estimate + tensor
        self.undo_log.remember(self.estimates, name)
        self.estimates[name] = estimate
        # A copy: Horovod installs the result as p.grad with set_, and in-place changes to p.grad
        # (clipping, zero_grad(set_to_none=False)) must not reach g.
        return estimate.clone()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "local": {name: t.detach().clone() for name, t in self.local.items()},
                "estimates": {name: t.detach().clone() for name, t in self.estimates.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.local = {name: t.clone() for name, t in state["local"].items()}
        self.estimates = {name: t.clone() for name, t in state["estimates"].items()}
