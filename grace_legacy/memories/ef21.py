"""EF21: error feedback by compressing the change of each rank's gradient estimate."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory
from grace_legacy.core.state import UndoLog


class EF21(Memory):
    """EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021), per tensor.

    Each rank ``i`` keeps ``g_i``, its running estimate of its own gradient, and every rank keeps
    the same ``g``, the running estimate of the synchronized gradient. At every step:

        sent_i = C(grad_i - g_i)                 what rank i compresses (compensate)
        g_i   <- g_i + D(sent_i)                 after sending (update)
        g     <- g + op_r D(sent_r)              on arrival (aggregated); g is applied

    ``op_r`` is what the communicator computes from the ranks' payloads: the mean with
    ``hvd.Average``, the sum with ``hvd.Sum``. By induction ``g == op_r g_i`` (up to floating
    rounding): with ``Average`` the applied gradient estimates the mean gradient, with ``Sum``
    the summed one. The op must therefore stay the same for the whole run: ``g`` accumulated
    under one op is in that op's scale.

    Initial state: ``g_i = 0`` and ``g = 0``, so the first step sends ``C(grad_i)`` and applies
    ``op_r D(C(grad_r))``; the paper's ``g_i^0 = C(grad_i(x^0))`` is the same thing, spent on
    step 0. A step sent dense (a LEGACY ``None``, density 1.0) sends ``grad_i - g_i`` exactly,
    which sets ``g_i = grad_i`` and ``g = op_r grad_r``: a dense step resynchronizes both.

    Unlike error feedback, nothing is "remembered" to be re-added: what is dropped is the part of
    the *change* of the gradient that ``C`` missed, and it is sent at a later step because
    ``grad_i - g_i`` still contains it. Runs with any compressor; the convergence theory asks for
    a contractive one, ``||D(C(x)) - x||^2 <= (1 - a) ||x||^2`` with ``a > 0`` (Top-k and DGC with
    ``a = k / n``; not Threshold, which sends nothing for a small enough difference). ``g_i`` and
    ``g`` are kept in the gradient's dtype and saved by :meth:`state_dict`.
    """

    # g is the mean over the world that was: once ranks leave or join it no longer equals the
    # mean of the g_i present, so every rank starts again from zero (the next step sends C(grad_i)).
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
        # Out of place (and a copy the first time): the decompressed payload may be a view of
        # what is on the wire, and g_i must not change with it.
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
