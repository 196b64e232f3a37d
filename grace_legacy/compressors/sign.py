"""1-bit compressors: signSGD, Signum, EF-signSGD and 1-bit SGD, with the bits really packed.

Every element travels as one bit, packed 8 to a byte (:mod:`grace_legacy.compressors.bits`):
``ceil(n / 8)`` bytes for ``n`` elements, plus each compressor's few scalars. None of the payloads
can be summed by an allreduce (a sum of packed bytes is not a sum of signs, and the scalars
differ per rank), so all four are gathered; their sizes depend only on ``n``, so
``uniform_payload`` holds and the gather carries no size header. On the wire (see
:mod:`grace_legacy.wire`) a tensor's buffer is padded to a multiple of 8 bytes.

The bit of an entry ``x`` is ``x >= 0``, in all four compressors:

* ``+0.0`` and ``-0.0`` read as positive (+1): one bit has no room for a third value. A gradient
  entry that is exactly zero on every rank therefore votes +1 in signSGD/Signum and moves its
  parameter by ``-lr``; EF-signSGD decodes it to ``+scale`` and its error feedback returns the
  difference at the next step; 1-bit SGD puts it on the non-negative side, whose mean it lowers.
* ``NaN`` reads as negative (``NaN >= 0`` is false) and ``+-inf`` as its sign. EF-signSGD and 1-bit
  SGD carry the non-finite value on in their scalars (the decoded tensor is then non-finite, as a
  dense allreduce would be), but signSGD and Signum send no magnitude and cannot: they hide an
  overflow from an AMP ``GradScaler``.

Gradients may be fp32, fp64, fp16 or bf16; sums and momenta of half-precision gradients are
accumulated in fp32. ``decompress`` and ``aggregate`` return the gradient's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from grace_legacy.compressors import sign_passes
from grace_legacy.compressors.bits import pack_bits, packed_length, unpack_bits
from grace_legacy.core import Compressor, Knob, Memory, Payload, StepJournal, check_gradient
from grace_legacy.memories.efsignsgd import check_learning_rate

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

MOMENTUM = Knob("momentum", low=0.0, high=1.0, low_inclusive=True, high_inclusive=False)


class SignContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device


def _check(tensor: torch.Tensor, owner: str) -> SignContext:
    check_gradient(tensor, owner)
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{owner}: gradients must be float32, float64, float16 or bfloat16, got {tensor.dtype}")
    return SignContext(tensor.shape, tensor.numel(), tensor.dtype, tensor.device)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision gradients (an fp16 sum overflows at 65504), else the dtype itself."""
    return torch.promote_types(dtype, torch.float32)


def _pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """The packed bits of ``tensor >= 0``: on a CPU in one compiled pass, without a bool tensor."""
    if sign_passes.kernels_apply(tensor):
        return sign_passes.pack_nonnegative(tensor)
    return pack_bits(tensor.reshape(-1) >= 0)


def _choose(packed: torch.Tensor, ctx: SignContext, if_set: torch.Tensor, if_clear: torch.Tensor) -> torch.Tensor:
    """The decoded tensor, in the gradient's shape and dtype: ``if_set`` where the packed bit is
    1 (``x >= 0``), ``if_clear`` where it is 0; both are scalars of that dtype."""
    if sign_passes.kernels_apply(if_set) and packed.device.type == "cpu":
        return sign_passes.choose(packed, ctx.numel, if_set.item(), if_clear.item(), ctx.dtype).view(ctx.shape)
    return torch.where(unpack_bits(packed, ctx.numel), if_set, if_clear).view(ctx.shape)


def majority_vote(payloads: Sequence[Payload], ctx: SignContext) -> torch.Tensor:
    """``sign(sum_r s_r)`` from every rank's packed signs ``s_r`` (+-1): +1 or -1 where a strict
    majority agrees, 0 where the vote ties (an even number of ranks, split evenly)."""
    ranks = len(payloads)
    # The narrowest count that holds 2 * ranks (a bool sum over a stacked dim is many times slower).
    count_dtype = torch.int16 if 2 * ranks <= torch.iinfo(torch.int16).max else torch.int32
    positive = unpack_bits(payloads[0][0], ctx.numel).to(count_dtype)
    for payload in payloads[1:]:
        positive += unpack_bits(payload[0], ctx.numel)
    return torch.sign(positive.mul_(2).sub_(ranks)).to(ctx.dtype).view(ctx.shape)


class _MajorityVote(Compressor):
    """What signSGD and Signum share: a payload of packed signs only, aggregated by a vote."""

    # A dense mean would change the update, not only the bytes: never swap it in.
    aggregates_by_mean = False

    def decompress(self, payload: Payload, ctx: SignContext) -> torch.Tensor:
        one = torch.ones((), dtype=ctx.dtype, device=ctx.device)
        return _choose(payload[0], ctx, one, -one)

    def aggregate(self, payloads: Sequence[Payload], ctx: SignContext, average: bool) -> torch.Tensor:
        """The majority vote (:func:`majority_vote`), whatever ``average`` says: a vote is not a
        sum, so there is nothing to divide (``op=hvd.Sum`` gets the same +-1/0 tensor)."""
        return majority_vote(payloads, ctx)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(packed_length(numel), torch.uint8)]


class SignSGD(_MajorityVote):
    """signSGD with majority vote (Bernstein et al., 2018).

    Each rank sends ``s = sign(g)`` (``+1`` where ``g >= 0``, see the module docstring), packed:
    ``[bits]``, ``ceil(n / 8)`` ``uint8`` bytes, i.e. 1/8 byte per element. The synchronized
    gradient is the vote ``sign(sum_r s_r)``, in {-1, 0, +1}, 0 on ties. No knob, no memory.
    """

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = _check(tensor, "SignSGD")
        return [_pack_signs(tensor)], ctx


class Signum(_MajorityVote):
    """signSGD with momentum (Signum; Bernstein et al., 2018), aggregated by majority vote.

    Per tensor, with ``m_0 = 0`` and ``beta = momentum`` in ``[0, 1)``:

        m_t = beta * m_{t-1} + (1 - beta) * g_t,    sends sign(m_t)

    so ``momentum=0`` is :class:`SignSGD`. The momentum is kept here (fp32 for half-precision
    gradients, else the gradient's dtype), before compression, on each rank for its own gradient,
    and is saved by :meth:`state_dict`. Payload and aggregation as :class:`SignSGD`: ``ceil(n / 8)``
    bytes, the vote ``sign(sum_r sign(m_r))``, 0 on ties. Each call to :meth:`compress` is one step.
    """

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        if momentum is None:
            raise TypeError(f"Signum: momentum must be {MOMENTUM.describe_range()}, got None")
        self.momentum: float = MOMENTUM.check(momentum, "Signum")
        self.momentum_buffers: dict[str, torch.Tensor] = {}
        self._journal = StepJournal()

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = _check(tensor, "Signum")
        accumulator = _accumulator(tensor.dtype)
        previous = self.momentum_buffers.get(name)
        if previous is not None and (previous.shape != tensor.shape or previous.dtype != accumulator):
            raise ValueError(f"Signum: tensor {name!r} changed from {tuple(previous.shape)} {previous.dtype} "
                             f"momentum to a {tuple(tensor.shape)} {tensor.dtype} gradient")
        self._journal.remember(self.momentum_buffers, name)
        if previous is None:
            previous = torch.zeros(tensor.shape, dtype=accumulator, device=tensor.device)
        # Out of place, so that a skipped step can put the old buffer back.
        if sign_passes.kernels_apply(tensor) and previous.is_contiguous():
            buffer, packed = sign_passes.momentum_step(previous, tensor, self.momentum)
        else:
            buffer = previous * self.momentum + tensor.to(accumulator) * (1.0 - self.momentum)
            packed = _pack_signs(buffer)
        self.momentum_buffers[name] = buffer
        return [packed], ctx

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "momentum_buffers": {name: m.detach().clone() for name, m in self.momentum_buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.momentum_buffers = {name: m.clone() for name, m in state["momentum_buffers"].items()}

    def __repr__(self) -> str:
        return f"Signum(momentum={self.momentum!r})"


class EFSignSGD(Compressor):
    """EF-signSGD (Karimireddy et al., 2019; GRACE's ``efsignsgd``): the scaled sign of the
    error-compensated step, with :class:`~grace_legacy.memories.EFSignSGDMemory`.

    The memory hands over ``p = lr * g + e`` (``lr`` the optimizer's learning rate). This sends

        C(p) = (||p||_1 / n) * sign(p)

    as ``[bits, scale]``: ``ceil(n / 8)`` ``uint8`` bytes and one scale in the gradient's dtype
    (computed in fp32 for half precision), i.e. 1/8 byte per element plus 2, 4 or 8 bytes.
    ``decompress`` gives ``scale * (+-1)`` in units of ``p``. The aggregate is the mean over ranks
    of each rank's own ``scale_r * sign_r`` (the sum with ``average=False``): every rank has its
    own scale, so it is gathered. The memory divides that by ``lr`` (``Memory.aggregated``) and
    keeps ``e <- p - C(p)``, so the optimizer's step ``lr * (mean_r C(p_r) / lr)`` is exactly the
    mean of the ranks' EF-signSGD steps.

    Only ``EFSignSGDMemory`` with the same ``lr`` is accepted (:meth:`check_memory`); it is the
    default when ``memory=None``.
    """

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = check_learning_rate(lr, "EFSignSGD")

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = _check(tensor, "EFSignSGD")
        flat = tensor.reshape(-1)
        if sign_passes.kernels_apply(flat):
            packed, nonnegative, negative, _ = sign_passes.pack_and_sum_sides(flat)
            # sum |x_i| in float64; a NaN on the negative side stays NaN, an inf stays inf.
            scale = torch.tensor([(nonnegative - negative) / ctx.numel], dtype=tensor.dtype)
            return [packed, scale], ctx
        scale = torch.mean(flat.abs(), dtype=_accumulator(tensor.dtype)).to(tensor.dtype).reshape(1)
        return [pack_bits(flat >= 0), scale], ctx

    def decompress(self, payload: Payload, ctx: SignContext) -> torch.Tensor:
        packed, scale = payload
        return _choose(packed, ctx, scale[0], -scale[0])

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(packed_length(numel), torch.uint8), (1, dtype)]

    def recommended_memory(self) -> Memory:
        from grace_legacy.memories import EFSignSGDMemory

        return EFSignSGDMemory(self.lr)

    def check_memory(self, memory: Memory) -> None:
        from grace_legacy.memories import EFSignSGDMemory

        if not isinstance(memory, EFSignSGDMemory):
            raise ValueError(
                f"{self!r} needs EFSignSGDMemory(lr={self.lr!r}), got {memory!r}: its error feedback works "
                f"in units of lr * gradient and its aggregate is divided back by lr; leave memory=None")
        if memory.lr != self.lr:
            raise ValueError(f"{self!r} needs EFSignSGDMemory(lr={self.lr!r}) with the same learning rate, "
                             f"got {memory!r}")

    def __repr__(self) -> str:
        return f"EFSignSGD(lr={self.lr!r})"


class OneBit(Compressor):
    """1-bit SGD (Seide et al., 2014; GRACE's ``onebit``), meant to run with error feedback.

    One bit per entry says its side, non-negative (``x >= 0``) or negative, and two scalars give
    each side's mean:

        mu_+ = mean{x_i : x_i >= 0},   mu_- = mean{x_i : x_i < 0}   (0 for an empty side)
        D(x)_i = mu_+ if x_i >= 0 else mu_-

    Payload ``[bits, means]`` with ``means = [mu_+, mu_-]`` in the gradient's dtype (the sums are
    accumulated in fp32 for half precision): ``ceil(n / 8)`` bytes plus 4, 8 or 16, i.e. 1/8 byte
    per element. Each side's sum is kept, so ``sum_i D(x)_i == sum_i x_i`` up to rounding. Not a
    vote: the aggregate is the mean over ranks of the decoded tensors (the sum with
    ``average=False``). Recommended memory: ``Residual``, which returns what the two means dropped.
    """

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = _check(tensor, "OneBit")
        flat = tensor.reshape(-1)
        if sign_passes.kernels_apply(flat):
            packed, up, down, count = sign_passes.pack_and_sum_sides(flat)
            # A side with no entry has sum 0 and mean 0.
            means = torch.tensor([up / max(count, 1), down / max(ctx.numel - count, 1)], dtype=tensor.dtype)
            return [packed, means], ctx
        nonnegative = flat >= 0
        wide = flat.to(_accumulator(tensor.dtype))
        zero = wide.new_zeros(())
        sums = torch.stack([torch.where(nonnegative, wide, zero).sum(), torch.where(nonnegative, zero, wide).sum()])
        count = nonnegative.sum()
        # A side with no entry has sum 0; dividing by 1 makes its mean 0 without a branch (no sync).
        counts = torch.stack([count, ctx.numel - count]).clamp(min=1)
        means = (sums / counts).to(tensor.dtype)
        return [pack_bits(nonnegative), means], ctx

    def decompress(self, payload: Payload, ctx: SignContext) -> torch.Tensor:
        packed, means = payload
        return _choose(packed, ctx, means[0], means[1])

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(packed_length(numel), torch.uint8), (2, dtype)]

    def recommended_memory(self) -> Memory:
        from grace_legacy.memories import Residual

        return Residual()
