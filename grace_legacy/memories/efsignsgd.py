"""Error feedback kept in units of parameter updates, for EF-signSGD (Karimireddy et al., 2019)."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.memories.residual import Residual

LEARNING_RATE = ScheduledParameter("lr", low=0.0, low_inclusive=False, high_inclusive=False)


def check_learning_rate(lr: Any, owner: str) -> float:
    """``lr`` as a float if it is a finite number > 0, else a ``TypeError``/``ValueError`` naming ``owner``."""
    if lr is None:  # ScheduledParameter.check lets None through (it means "dense" there); here it is a mistake
        raise TypeError(f"{owner}: lr must be {LEARNING_RATE.describe_range()} (the optimizer's learning "
                        f"rate), got None")
    return LEARNING_RATE.check(lr, owner)


class EFSignSGDMemory(Residual):
    """The error feedback of EF-signSGD (Karimireddy et al. 2019, Algorithm 1; GRACE's
    ``EFSignSGDMemory``), kept per tensor in units of parameter updates.

    With ``C``/``D`` the compressor, ``g_t`` this rank's gradient and ``e_0 = 0``:

        p_t      = lr * g_t + e_t                  (compensate)
        e_{t+1}  = p_t - D(C(p_t))                 (update, as Residual)
        applied  = aggregate_r D(C(p_t)) / lr      (aggregated)

    ``aggregate`` is the mean over ranks (the sum with ``op=hvd.Sum``), so an SGD optimizer with
    learning rate ``lr`` moves the parameters by exactly the mean of the ranks' compressed steps
    ``D(C(p_t))``, the update of EF-signSGD. ``lr`` must be the optimizer's learning rate; if the
    optimizer's is ``lr'``, the step is scaled by ``lr' / lr``.

    Why ``lr`` inside the memory: the error is what the parameters should have moved but did not,
    so it stays meaningful when the learning rate changes between runs (a checkpoint saves the
    error, not ``lr``). For a fixed ``lr`` and a positively homogeneous compressor (scaled sign:
    ``C(lr * x) = lr * C(x)``) this equals ``Residual`` on the gradient itself, up to rounding.

    Dividing the aggregate here rather than in the compressor keeps the conversion route-independent:
    a tensor sent dense (``lr * g + e`` through an allreduce) comes back as ``g + e / lr`` too.
    Half precision: ``lr * g`` is formed in the gradient's dtype, so fp16 flushes ``|lr * g|`` below
    ``6e-8`` to zero; prefer fp32 or bf16 gradients.
    """

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
