"""Error feedback kept in units of parameter updates, for EF-signSGD (Karimireddy et al., 2019)."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.memories.residual import Residual

LEARNING_RATE = ScheduledParameter("lr", low=0.0, low_inclusive=False, high_inclusive=False)


def check_learning_rate(lr: Any, owner: str) -> float:
    """``lr`` as a float if it is a finite number > 0, else a ``TypeError``/``ValueError`` naming ``owner``."""
    if lr is None:  # ScheduledParameter.check lets None ("dense") through; here it is a mistake
        raise TypeError(f"{owner}: lr must be {LEARNING_RATE.describe_range()} (the optimizer's learning "
                        f"rate), got None")
    return LEARNING_RATE.check(lr, owner)


class EFSignSGDMemory(Residual):
    """The error feedback of EF-signSGD (Karimireddy et al. 2019, Algorithm 1; GRACE's
    ``EFSignSGDMemory``), per tensor in units of parameter updates
    (docs/DESIGN.md#ef-signsgd-learning-rate). With ``e_0 = 0``:

        p_t      = lr * g_t + e_t                  (compensate)
        e_{t+1}  = p_t - D(C(p_t))                 (update, as Residual)
        applied  = aggregate_r D(C(p_t)) / lr      (aggregated, on every route)

    so SGD with learning rate ``lr`` moves the parameters by exactly the mean (``hvd.Sum``: the sum)
    of the ranks' steps ``D(C(p_t))``. ``lr`` must be the optimizer's: with ``lr'`` the step scales
    by ``lr' / lr``. ``lr * g`` is formed in the gradient's dtype, so fp16 flushes ``|lr * g|`` below
    ``6e-8`` to zero; prefer fp32 or bf16 gradients."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = check_learning_rate(lr, "EFSignSGDMemory")

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return super().compensate(tensor * self.lr, name)

    def compensate_into(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return super().compensate_into(tensor.mul_(self.lr), name)

    def aggregated(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor / self.lr

    def __repr__(self) -> str:
        return f"EFSignSGDMemory(lr={self.lr!r})"
