"""Variance-based sparsification: an entry is sent once its accumulated gradient stands out from
its accumulated noise."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from grace_legacy.compressors.entries import OwnFeedback
from grace_legacy.compressors.kernels import accumulating
from grace_legacy.compressors.kernels.sign_passes import accumulator_dtype
from grace_legacy.compressors.per_sample import MomentSource, SampleMoments
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.core.backend import Backend
from grace_legacy.core.compressor import Payload, Tunable
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.traits import Traits
from grace_legacy.runtime.validation import check_gradient, required

ALPHA = ScheduledParameter("alpha", low=0.0, low_inclusive=False)
KSI = ScheduledParameter("ksi", low=0.0, high=1.0)


class VarianceSparsifier(OwnFeedback, Tunable):
    """Variance-based gradient compression (Tsuzuku, Imachi and Akiba, 2018, "Variance-based
    gradient compression for efficient distributed deep learning"). Per entry ``i`` of a tensor, two
    running sums, 0 at first: ``r``, of the gradient, and ``v``, of its per-sample second moment
    ``m_i = sum_z c_zi^2`` (``c_z``: sample ``z``'s share of the gradient, :class:`SampleMoments`),
    an estimate of the variance of ``r``. Each step, with ``g`` the gradient:

        r <- r + g,   v <- v + m
        sent where r_i^2 > alpha * v_i, as r_i; then r_i <- 0 and v_i <- 0 there,
        and v_i <- ksi * v_i elsewhere (r_i stays)

    so an entry waits until its sum is unambiguous (large against its noise), and old noise fades
    by ``ksi`` per step. ``alpha`` is the parameter a schedule may set (larger: fewer entries);
    the LEGACY reference's defaults are ``alpha = 2`` (1.5 in its other script) and ``ksi = 0.999``.
    The paper also quantizes the values it sends; here they go exact, as in the LEGACY reference,
    whose moment is the per-sample mean ``sum_z grad f_z^2 / B`` rather than the paper's ``/ B^2``
    (the same test with ``alpha`` scaled by ``B``).

    The per-sample moments come from hooks on the model: ``sparsifier.attach(model)`` hooks every
    ``nn.Linear`` and ``nn.Conv2d`` layer (:class:`SampleMoments`) and refuses a model with any other
    trainable parameter; attach the module whose ``named_parameters()`` name the gradients (the
    one given to ``hvd.DistributedOptimizer(named_parameters=...)``, or the model inside DDP).
    ``attach`` also takes any :class:`MomentSource`. Moments not taken by the end of a step are
    dropped (a tensor sent dense that step).

    ``r`` and ``v`` are this compressor's memory (``NoMemory`` with it; another memory is refused),
    kept in float32 for 16-bit gradients (values are sent in the gradient's dtype, what that
    rounding drops stays in ``r``), undone with a skipped step, saved by :meth:`state_dict`. Payload
    ``[values, increasing indices]``, its size chosen by the data (gathered with a header), each
    rank's entries summed exactly; not cut into shards (``ScatterGather``): the moments are the
    whole tensor's. On a CPU, one compiled pass (:mod:`~grace_legacy.compressors.kernels.accumulating`)."""

    parameter = ALPHA
    traits = Traits(uniform_payload=False, shardable=False)
    stores = ("sums", "variances")

    def __init__(self, alpha: float | None = None, ksi: float = 0.999) -> None:
        super().__init__()
        self._set_value(alpha)
        self.ksi = required(KSI, ksi, "VarianceSparsifier")
        self.sums: dict[str, torch.Tensor]
        self.variances: dict[str, torch.Tensor]
        self.moments: MomentSource | None = None

    @property
    def alpha(self) -> float | None:
        return self.value

    def attach(self, source: nn.Module | MomentSource) -> MomentSource:
        """Take the per-sample moments from ``source``: a model (its ``Linear`` and ``Conv2d``
        layers are hooked, :class:`SampleMoments`) or a :class:`MomentSource`; returns the source
        (``.remove()`` takes a model's hooks off)."""
        if isinstance(source, nn.Module):
            source = SampleMoments(source)
        elif not (callable(getattr(source, "take", None)) and callable(getattr(source, "clear", None))):
            raise TypeError(f"VarianceSparsifier.attach: source must be a torch.nn.Module or have take(name, gradient) "
                            f"and clear(), got {type(source).__name__}")
        self.moments = source
        return source

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "VarianceSparsifier")
        self.check_ready()
        if self.moments is None:
            raise ValueError("VarianceSparsifier needs each gradient's per-sample second moments: call "
                             "sparsifier.attach(model) on the model whose gradients it compresses")
        flat = tensor.reshape(-1)
        state = accumulator_dtype(tensor.dtype)
        moment = self.moments.take(name, tensor).reshape(-1)
        r, v = self.sums.get(name), self.variances.get(name)
        if r is None or v is None:
            r = v = torch.zeros(flat.numel(), dtype=state, device=tensor.device)
        elif r.shape != flat.shape or r.dtype != state:
            raise ValueError(f"VarianceSparsifier: tensor {name!r} changed from {r.numel()}-entry {r.dtype} sums "
                             f"to a {tuple(tensor.shape)} {tensor.dtype} gradient")
        indices = index_dtype(flat.numel())
        if accumulating.kernels_apply(r, v, flat, moment):
            sent, positions, r, v = accumulating.variance_pass(r.numpy(), v.numpy(), flat.numpy(), moment.numpy(),
                                                              self.alpha, self.ksi, accumulating.NUMPY_INDEX[indices])
            values, positions, r, v = (torch.from_numpy(a) for a in (sent, positions, r, v))
        else:
            values, positions, r, v = variance_test(r, v, flat.to(state), moment, self.alpha, self.ksi, tensor.dtype)
            positions = positions.to(indices)
        self._keep(name, sums=r, variances=v)
        return [values, positions], SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        raise NotImplementedError("VarianceSparsifier sends the entries whose sums pass its test, so its payload size "
                                  "depends on the gradients, not only on the tensor's size")

    def end_step(self, backend: Backend | None = None) -> None:
        super().end_step(backend)
        if self.moments is not None:
            self.moments.clear()

    def __repr__(self) -> str:
        return f"VarianceSparsifier(alpha={self.alpha!r}, ksi={self.ksi!r})"


def variance_test(r: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, moment: torch.Tensor, alpha: float,
                  ksi: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The variance test as tensor formulas (any device), all 1-D in the state's dtype, the values
    sent in ``dtype``: ``(values, int64 positions, next r, next v)``."""
    total = r + grad
    noise = v + moment
    sent = total * total > alpha * noise
    positions = torch.nonzero(sent).reshape(-1)
    chosen = total.index_select(0, positions)
    values = chosen.to(dtype)
    next_r = total.index_put((positions,), chosen - values.to(total.dtype))
    next_v = torch.where(sent, torch.zeros((), dtype=noise.dtype, device=noise.device), ksi * noise)
    return values, positions, next_r, next_v
