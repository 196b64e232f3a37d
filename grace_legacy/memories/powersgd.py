"""PowerSGD's error feedback (Vogels et al., 2019)."""

from __future__ import annotations

from grace_legacy.memories.residual import Residual


class PowerSGDMemory(Residual):
    """PowerSGD's error feedback (Vogels et al. 2019, Algorithm 2): ``e_w <- M_w - P^ Q_w^T``, the
    rule of :class:`Residual` applied to PowerSGD's last *local* payload ``Q_w``. Tensors sent dense
    keep no residual; the warm start lives in the compressor."""
