"""signSGD and Signum: packed signs and a majority vote (see :mod:`~grace_legacy.compressors.signs`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from grace_legacy.compressors.kernels import sign_passes
from grace_legacy.compressors.kernels.bits import pack_bits, packed_length, unpack_bits
from grace_legacy.compressors.kernels.sign_passes import accumulator_dtype
from grace_legacy.compressors.signs import SignContext, choose, sign_context
from grace_legacy.core.compressor import Compressor, Payload
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.state import UndoLog
from grace_legacy.core.traits import Traits

MOMENTUM = ScheduledParameter("momentum", low=0.0, high=1.0, low_inclusive=True, high_inclusive=False)


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


class VoteCode(Compressor):
    """A majority vote's result (+1, 0 or -1 per element) as two bits each, in one ``uint8`` part:
    the packed ``v > 0`` bits, then the packed ``v != 0`` bits. Lossless on votes, so that a
    scatter-gather's owners pass the vote on exactly, ties included; any other tensor becomes its
    sign (0 for zeros)."""

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = sign_context(tensor, "VoteCode")
        return [torch.cat([pack_bits(tensor > 0), pack_bits(tensor != 0)])], ctx

    def decompress(self, payload: Payload, ctx: SignContext) -> torch.Tensor:
        half = packed_length(ctx.numel)
        positive = unpack_bits(payload[0][:half], ctx.numel)
        nonzero = unpack_bits(payload[0][half:], ctx.numel)
        signs = positive.to(ctx.dtype).mul_(2).sub_(1)
        return signs.mul_(nonzero.to(ctx.dtype)).view(ctx.shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(2 * packed_length(numel), torch.uint8)]


class _MajorityVote(Compressor):
    """What signSGD and Signum share: a payload of packed signs only, aggregated by a vote."""

    # A dense mean would change the update, not only the bytes: never swap it in.
    traits = Traits(aggregates_by_mean=False)

    def decompress(self, payload: Payload, ctx: SignContext) -> torch.Tensor:
        one = torch.ones((), dtype=ctx.dtype, device=ctx.device)
        return choose(payload[0], ctx, one, -one)

    def aggregate(self, payloads: Sequence[Payload], ctx: SignContext, average: bool) -> torch.Tensor:
        """The majority vote (:func:`majority_vote`) whatever ``average`` says: a vote is not a sum."""
        return majority_vote(payloads, ctx)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(packed_length(numel), torch.uint8)]

    def for_sums(self) -> Compressor:
        """:class:`VoteCode`: a vote's ties (0) do not fit in one bit."""
        return VoteCode()


class SignSGD(_MajorityVote):
    """signSGD with majority vote (Bernstein et al., 2018): each rank sends ``s = sign(g)`` (+1 where
    ``g >= 0``) as ``ceil(n / 8)`` bytes; the synchronized gradient is ``sign(sum_r s_r)``, 0 on ties.
    No parameter, no memory."""

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = sign_context(tensor, "SignSGD")
        return [sign_passes.pack_nonnegative(tensor)], ctx


class Signum(_MajorityVote):
    """signSGD with momentum (Signum; Bernstein et al., 2018), aggregated by majority vote. Per
    tensor and call to :meth:`compress`, with ``m_0 = 0`` and ``beta = momentum`` in ``[0, 1)``:

        m_t = beta * m_{t-1} + (1 - beta) * g_t,    sends sign(m_t)

    (``momentum=0`` is :class:`SignSGD`). Each rank keeps its own ``m`` (fp32 for half-precision
    gradients), saved by :meth:`state_dict`. Payload and vote as :class:`SignSGD`."""

    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        if momentum is None:
            raise TypeError(f"Signum: momentum must be {MOMENTUM.describe_range()}, got None")
        self.momentum: float = MOMENTUM.check(momentum, "Signum")
        self.momentum_buffers: dict[str, torch.Tensor] = {}
        self.undo_log = UndoLog()

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        ctx = sign_context(tensor, "Signum")
        accumulator = accumulator_dtype(tensor.dtype)
        previous = self.momentum_buffers.get(name)
        if previous is not None and (previous.shape != tensor.shape or previous.dtype != accumulator):
            raise ValueError(f"Signum: tensor {name!r} changed from {tuple(previous.shape)} {previous.dtype} "
                             f"momentum to a {tuple(tensor.shape)} {tensor.dtype} gradient")
        self.undo_log.remember(self.momentum_buffers, name)
        if previous is None:
            previous = torch.zeros(tensor.shape, dtype=accumulator, device=tensor.device)
        # Out of place, so that a skipped step can put the old buffer back.
        buffer, packed = sign_passes.momentum_step(previous, tensor, self.momentum)
        self.momentum_buffers[name] = buffer
        return [packed], ctx

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "momentum_buffers": {name: m.detach().clone() for name, m in self.momentum_buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.momentum_buffers = {name: m.clone() for name, m in state["momentum_buffers"].items()}

    def rejoin_state(self, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        # The momentum is of this rank's own gradients, like error feedback: a survivor keeps it.
        return {**super().rejoin_state(shared, own), "momentum_buffers": own["momentum_buffers"]}

    def __repr__(self) -> str:
        return f"Signum(momentum={self.momentum!r})"
