"""PowerSGD's error feedback (Vogels et al., 2019)."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.memories.residual import Residual


class PowerSGDMemory(Residual):
    """PowerSGD's error feedback (Vogels et al. 2019, Algorithm 2): ``e_w <- M_w - P^ Q_w^T``, the
    rule of :class:`Residual` applied to PowerSGD's last *local* payload ``Q_w``. Tensors sent dense
    keep no residual; the warm start lives in the compressor."""

    def compensate_borrowed(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        # g + e in the lent storage: the residual is computed from it into a buffer of this
        # memory's own (PowerSGD sends no entries, so the compensated tensor never becomes one).
        residual = self._residual_for(tensor, name)
        return tensor if residual is None else tensor.detach().add_(residual)

    def _left_out(self, compensated: torch.Tensor, name: str, compressor: Compressor, payload: Payload,
                  ctx: Any) -> torch.Tensor:
        # M - P^ Q_w^T in one pass where PowerSGD can (its subtract_decoded): the bits of
        # decoding and subtracting, without the decoded n x m tensor.
        subtract = getattr(compressor, "subtract_decoded", None)
        if subtract is not None and not compensated.requires_grad:
            left = subtract(compensated, payload, ctx, self._kept("residual", name, compensated))
            if left is not None:
                return left
        return super()._left_out(compensated, name, compressor, payload, ctx)
