"""PowerSGD's error feedback (Vogels et al., 2019)."""

from __future__ import annotations

from grace_legacy.memories.residual import Residual


class PowerSGDMemory(Residual):
    """PowerSGD's error feedback (Vogels et al. 2019, Algorithm 2): ``e_w <- M_w - P^ Q_w^T``.

    The same rule as :class:`Residual`: the bundle hands the memory PowerSGD's last *local*
    payload ``Q_w``, which decodes against the shared ``P^`` to this worker's share of the
    approximation. Tensors PowerSGD sends dense (1-D, or too small to factor) keep no residual.
    The warm-start ``Q`` lives in the compressor, which must re-draw it when a schedule changes
    the rank.
    """
