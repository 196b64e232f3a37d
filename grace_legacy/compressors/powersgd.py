"""PowerSGD: rank-r approximation by one step of power iteration, warm-started across steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grace_legacy.compressors.kernels import products
from grace_legacy.core.compressor import Compressor, MultiRound, Payload, Randomized, Tunable
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.state import UndoLog
from grace_legacy.core.traits import Traits
from grace_legacy.memories.powersgd import PowerSGDMemory
from grace_legacy.runtime import paths
from grace_legacy.runtime.buffers import MMAP_CEILING, BufferPool
from grace_legacy.runtime.validation import check_gradient

RANK = ScheduledParameter("rank", low=1, integer=True)


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The matrix a tensor is viewed as: its first dimension by the product of the others."""
    return shape[0], (shape.numel() // shape[0]) if shape[0] else 0


def orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``p``'s column space (reduced QR): the same on every rank, which holds
    the same reduced ``p``."""
    return torch.linalg.qr(p, mode="reduced").Q


@dataclass
class PowerContext:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    matrix: torch.Tensor         # M: this rank's compensated gradient as an n x m matrix
    p_hat: torch.Tensor | None = None


class PowerSGD(MultiRound, Randomized, Tunable):
    """Rank-``r`` PowerSGD (Vogels, Karimireddy and Jaggi, 2019). A gradient viewed as an ``n x m``
    matrix ``M_w`` on worker ``w`` is approximated by one step of subspace iteration from the
    previous step's ``Q`` (``m x r``):

        P   = sum_w M_w Q               allreduce 1: n*r values
        P^  = orthonormal_columns(P)
        Q_w = M_w^T P^                  allreduce 2: m*r values
        M'  = P^ (sum_w Q_w)^T          the aggregate (divided by the world size for op=Average)

    ``sum_w Q_w`` warm-starts the next step. The first ``Q`` is drawn from ``N(0, 1)`` keyed by
    ``(seed, name, step)`` without the rank, so every rank starts alike (again at a change of rank).
    Sent dense: tensors of fewer than 2 dimensions and matrices with ``(n + m) * r >= n * m``.
    fp16/bf16 gradients are factored and sent in fp32 (QR needs it) and returned in their dtype.
    On the CPU's own path the three products are compiled loops with an order of additions fixed by
    the shapes (:mod:`~grace_legacy.compressors.kernels.products`), so results do not depend on the
    thread count as a BLAS's do; elsewhere torch's products."""

    parameter = RANK
    # An inf or NaN in M makes P = M Q non-finite, and every rank's sum of P, so every rank's P Q^T.
    traits = Traits(additive=True, delivers_nonfinite=True, rounds=2)

    def __init__(self, rank: int | None = None, seed: int = 0) -> None:
        super().__init__()
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"PowerSGD: seed must be an int, got {seed!r}")
        self._set_value(rank)
        self.seed = seed
        # Shared with with_value copies (a shallow copy keeps the dict), like the step counters.
        self._warm_q: dict[str, torch.Tensor] = {}
        self.undo_log = UndoLog()
        # Outputs above glibc's mmap ceiling are kept per shape (docs/DESIGN.md#kept-buffers).
        self._outputs = BufferPool(min_bytes=MMAP_CEILING)

    @property
    def rank_r(self) -> int | None:
        """The approximation rank (``rank`` is this process's rank among the workers)."""
        return self.value

    def compressor_for(self, tensor: torch.Tensor, name: str) -> Compressor | None:
        chosen = super().compressor_for(tensor, name)
        if chosen is None or tensor.dim() < 2:
            return None
        n, m = matrix_shape(tensor.shape)
        return None if (n + m) * self.rank_r >= n * m else chosen

    @staticmethod
    def _work_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def _start_q(self, name: str, m: int, dtype: torch.dtype, device: torch.device, step: int) -> torch.Tensor:
        q = self._warm_q.get(name)
        if q is not None and q.shape == (m, self.rank_r) and q.dtype == dtype:
            return q
        generator = self.generator(self.seed, name, step, per_rank=False)
        return torch.randn(m, self.rank_r, generator=generator, dtype=dtype).to(device)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "PowerSGD")
        self.check_ready()
        if tensor.dim() < 2:
            raise ValueError(f"PowerSGD: {name!r} has {tensor.dim()} dimension(s); tensors of fewer than 2 are "
                             f"sent dense (resolve() returns None for them)")
        step = self.next_step(name)
        work = self._work_dtype(tensor.dtype)
        matrix = tensor.reshape(matrix_shape(tensor.shape)).to(work)
        q = self._start_q(name, matrix.shape[1], work, tensor.device, step)
        p = products.matrix_times(matrix, q)
        return [p], PowerContext(name, tensor.shape, tensor.dtype, matrix)

    def next_round(self, reduced: Payload, ctx: PowerContext) -> tuple[Payload, PowerContext]:
        ctx.p_hat = orthonormal_columns(reduced[0])
        # M^T P^ as (P^T M)^T: QR's Q is column-major, and torch multiplies a transposed M by it
        # an order of magnitude slower on a CPU.
        return [products.transposed_times(ctx.p_hat, ctx.matrix).t().contiguous()], ctx

    def end_exchange(self, reduced: Payload, ctx: PowerContext) -> None:
        self.undo_log.remember(self._warm_q, ctx.name)
        self._warm_q[ctx.name] = reduced[0].clone()

    @staticmethod
    def _decoded_shape(payload: Payload, ctx: PowerContext, caller: str) -> tuple[int, int]:
        """The n x m matrix that ``P^ Q^T`` makes, once the second round has given ``Q``."""
        if ctx.p_hat is None:
            raise ValueError(f"PowerSGD: {caller} needs the second round's payload (Q), after next_round")
        return ctx.p_hat.shape[0], payload[0].shape[0]

    def decompress(self, payload: Payload, ctx: PowerContext) -> torch.Tensor:
        n, m = self._decoded_shape(payload, ctx, "decompress")
        q = payload[0]
        out = self._outputs.empty((n, m, q.dtype), n * m, q.dtype, q.device).view(n, m)
        return products.times_transposed(ctx.p_hat, q, out=out).reshape(ctx.shape).to(ctx.dtype)

    def decompress_into(self, payload: Payload, ctx: PowerContext, out: torch.Tensor) -> torch.Tensor | None:
        n, m = self._decoded_shape(payload, ctx, "decompress")
        if out.dtype != ctx.p_hat.dtype or out.shape != ctx.shape or not out.is_contiguous():
            return None  # fp16/bf16 gradients are decoded in fp32 and cast
        products.times_transposed(ctx.p_hat, payload[0], out=out.view(n, m))
        return out

    def subtract_decoded(self, minuend: torch.Tensor, payload: Payload, ctx: PowerContext,
                         out: torch.Tensor) -> torch.Tensor | None:
        """``minuend - decompress(payload, ctx)`` in ``out`` (contiguous, ``minuend``'s shape and dtype),
        bit for bit, in one pass over the matrix (``products.minus_times_transposed``): the residual
        :class:`~grace_legacy.memories.PowerSGDMemory` keeps. ``None`` where the decoded
        tensor would be cast (fp16/bf16 gradients are factored in fp32): decode and subtract then."""
        n, m = self._decoded_shape(payload, ctx, "subtract_decoded")
        if minuend.dtype != ctx.p_hat.dtype or minuend.shape != ctx.shape:
            return None
        products.minus_times_transposed(minuend.reshape(n, m), ctx.p_hat, payload[0], out=out.view(n, m))
        return out

    def surely_finite(self, payload: Payload, ctx: PowerContext) -> bool:
        """Each element of ``P^ Q^T`` is a sum of ``r`` products, so at most ``r max|P^| max|Q|``;
        that bound twice over (for rounding) below the decoded dtype's largest value means no inf,
        and finite factors no NaN. Two reductions of the small factors on the CPU's own path
        (elsewhere each would wait for the device: the result is looked at there)."""
        self._decoded_shape(payload, ctx, "surely_finite")
        q = payload[0]
        if not paths.cpu_path(q):
            return False
        bound = float(ctx.p_hat.abs().amax()) * float(q.abs().amax()) * q.shape[1]
        return bound * 2 < torch.finfo(ctx.dtype).max  # False for a NaN or an inf

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        raise NotImplementedError("PowerSGD's payload depends on the matrix shape, not only on its element count; "
                                  "use payload_spec_for(shape, dtype)")

    def payload_spec_for(self, shape: torch.Size, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        n, m = matrix_shape(torch.Size(shape))
        work = self._work_dtype(dtype)
        return [(n * self.rank_r, work), (m * self.rank_r, work)]

    def recommended_memory(self):
        return PowerSGDMemory()

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank_r!r}, seed={self.seed})"

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "warm_q": {k: q.clone() for k, q in self._warm_q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._warm_q.clear()
        self._warm_q.update({k: q.clone() for k, q in state["warm_q"].items()})
