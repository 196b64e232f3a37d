"""Residual error feedback: what compression left out of a gradient is added to the next one."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.memory import Memory
from grace_legacy.core.state import UndoLog
from grace_legacy.runtime.buffers import LARGE, BufferPool


class Residual(Memory):
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019), one residual per tensor. With
    ``e_0 = 0``:

        sent_t   = C(g_t + e_t)
        e_{t+1}  = (g_t + e_t) - D(sent_t)

    so what compression dropped is added to the next step's gradient. For a compressor that
    ``sends_entries``, ``e_{t+1}`` is the compensated tensor with the sent entries zeroed in place
    (docs/DESIGN.md#error-feedback-in-place): bit for bit the subtraction on finite entries; a sent
    inf or NaN leaves 0 there, in a step flagged non-finite anyway."""

    keeps_nonfinite = True  # g + e is non-finite wherever g is

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self.undo_log = UndoLog()
        # The g + e that compensate made this step, which no one else holds (see update).
        self._made: dict[str, torch.Tensor] = {}
        # Large results go into buffers kept per tensor (the previous step's residual is held until
        # the step ends, for a skipped step to restore), so that a step does not fault in fresh
        # pages (docs/DESIGN.md#kept-buffers); a buffer still held anywhere is not reused.
        self._buffers = BufferPool(min_bytes=LARGE)

    def _kept(self, purpose: str, name: str, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as ``like`` for ``purpose`` of ``name``, to be overwritten."""
        return self._buffers.empty((purpose, name), like.numel(), like.dtype, like.device).view(like.shape)

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        residual = self._residual_for(tensor, name)
        if residual is None:
            return tensor
        if tensor.requires_grad:  # out= takes no part in autograd
            compensated = self._made[name] = tensor + residual
            return compensated
        compensated = self._made[name] = torch.add(tensor, residual, out=self._kept("compensated", name, residual))
        return compensated

    def compensate_into(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        # g + e in g's storage; the residual is untouched (a rolled-back step finds it as it was),
        # and the result is a tensor object of its own: the caller may set_() p.grad elsewhere.
        residual = self._residual_for(tensor, name)
        compensated = self._made[name] = tensor.detach()
        if residual is not None:
            compensated.add_(residual)
        return compensated

    def _residual_for(self, tensor: torch.Tensor, name: str) -> torch.Tensor | None:
        residual = self.residuals.get(name)
        if residual is not None and (residual.shape != tensor.shape or residual.dtype != tensor.dtype):
            raise ValueError(f"Residual: tensor {name!r} changed from {tuple(residual.shape)} "
                             f"{residual.dtype} to {tuple(tensor.shape)} {tensor.dtype}")
        return residual

    def update(self, compensated: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        self.undo_log.remember(self.residuals, name)
        made = self._made.pop(name, None)
        if compressor.traits.lossless:
            self.residuals.pop(name, None)
            return
        if compressor.traits.sends_entries and made is compensated and compensated.is_contiguous():
            # compensate made this tensor and the payload holds copies of its entries, so it can
            # become the residual in place.
            compensated.view(-1).index_fill_(0, compressor.support(payload, ctx).to(compensated.device), 0)
            self.residuals[name] = compensated
            return
        self.residuals[name] = self._left_out(compensated, name, compressor, payload, ctx)

    def _left_out(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                  ctx: Any) -> torch.Tensor:
        """``compensated - D(payload)``: what compression left out of ``name`` this step."""
        decoded = compressor.decompress(payload, ctx)
        if decoded.dtype != compensated.dtype or decoded.shape != compensated.shape or compensated.requires_grad:
            return compensated - decoded
        return torch.sub(compensated, decoded, out=self._kept("residual", name, compensated))

    def end_step(self, backend=None) -> None:
        super().end_step(backend)
        self._made.clear()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "residuals": {name: r.detach().clone() for name, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.residuals = {name: r.clone() for name, r in state["residuals"].items()}
