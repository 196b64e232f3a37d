"""INCEPTIONN's error-bounded lossy compression (Li et al., MICRO 2018): each value in 0, 8, 16 or its
full width of bits, chosen by its exponent, with a 2-bit tag per value."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from grace_legacy.core.compressor import Payload, Tunable
from grace_legacy.core.memory import Memory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import check_gradient

#: The absolute error bound. Above 1 it would only drop values that are sent in full anyway.
ERROR_BOUND = ScheduledParameter("error_bound", low=0.0, high=1.0, low_inclusive=False, high_inclusive=True)

#: The tags, two bits each, four to a byte (the first value in the lowest two bits).
DROPPED, EIGHT_BITS, SIXTEEN_BITS, FULL = 0, 1, 2, 3
TAGS_PER_BYTE = 4


def step_exponent(error_bound: float) -> int:
    """``L = floor(log2(error_bound))``, exactly: the fixed-point step ``2**L`` is the largest power
    of two at or below the bound."""
    mantissa, exponent = math.frexp(error_bound)  # error_bound = mantissa * 2**exponent, mantissa in [0.5, 1)
    return exponent - 1


def tag_bytes(numel: int) -> int:
    """Bytes that ``numel`` 2-bit tags take."""
    return -(-numel // TAGS_PER_BYTE)


def pack_tags(tags: torch.Tensor) -> torch.Tensor:
    """Four 2-bit tags (uint8 in 0..3) to a byte, the first in the lowest bits."""
    padded = torch.zeros(tag_bytes(tags.numel()) * TAGS_PER_BYTE, dtype=torch.uint8, device=tags.device)
    padded[:tags.numel()] = tags
    quads = padded.view(-1, TAGS_PER_BYTE)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_tags(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:numel]


class InceptionnContext(NamedTuple):
    shape: torch.Size
    numel: int
    dtype: torch.dtype
    device: torch.device
    #: the fixed-point step 2**L
    step: float


class INCEPTIONN(Tunable):
    """INCEPTIONN's lossy compression of gradients (Li et al., "A Network-Centric Hardware/Algorithm
    Co-Design to Accelerate Distributed Training of Deep Neural Networks", MICRO 2018; GRACE's
    ``inceptionn``), with its error bound ``eb`` on the absolute error.

    Gradients are mostly in (-1, 1), where a value needs only the bits between its leading one and
    the bound. With ``2**L`` the largest power of two at or below ``eb`` and ``q = floor(|x| / 2**L)``
    (``|x|`` truncated to a multiple of ``2**L``), each value takes one of four forms, told by a
    2-bit tag:

    * ``|x| >= 1``, inf or NaN: sent in full (tag 3), in the gradient's dtype;
    * ``|x| < eb``: dropped (tag 0), decoded as 0;
    * else ``q < 2**7`` (the exponent of ``x`` is at most ``L + 6``): 8 bits, ``sign(x) q`` as int8
      (tag 1);
    * else ``q < 2**15`` (exponent at most ``L + 14``): 16 bits, ``sign(x) q`` as int16 (tag 2);
    * else in full (tag 3).

    Decoded: ``sign(x) q 2**L``, 0, or the value itself. So ``|x - D(x)| < eb`` for every ``|x| < 1``
    (truncation toward zero loses less than ``2**L <= eb``, a dropped value less than ``eb``), and
    ``D(x) = x`` for the rest. The arithmetic is exact (in float64, which holds every value of the
    four dtypes; a decoded value has no more significant bits than the value it came from).

    Payload ``[tags, full, q16, q8]``: ``ceil(n / 4)`` bytes of tags, then the values of each form
    in the order of the elements. Their sizes depend on the data, so ranks send different sizes
    (``uniform_payload = False``, a size header in the gather) and the dense fallback does not
    apply. Gathered, aggregated as the mean of the decoded tensors. An inf or NaN is sent as it is
    and reaches every rank. Scheduled parameter: ``error_bound``, in (0, 1] (a larger bound drops more values and
    needs fewer bits for the others). Recommended memory: :class:`~grace_legacy.memories.Residual`,
    which returns what truncation and dropping left out (a dropped value would otherwise be lost
    at every step).

    GRACE's TensorFlow version differs: it takes the bound's exponent as ``int(log10(eb / 2))``
    (so its default ``2e-10`` drops every value below ``2**-10``, not below ``2e-10``), splits
    the exponents between the bound and 1 in two halves for 8 and 16 bits whatever precision they
    need, keeps 6 and 14 fraction bits of the value as a fixed-point number in [0, 1) (so most of
    its 8-bit values decode to 0 or 1/64), and sends fp32 in full. This one keeps the bound the
    paper states, for every value below 1.
    """

    parameter = ERROR_BOUND
    traits = Traits(uniform_payload=False, delivers_nonfinite=True)

    def __init__(self, error_bound: float | None = None) -> None:
        super().__init__()
        self._set_value(error_bound)

    @property
    def error_bound(self) -> float | None:
        return self.value

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "INCEPTIONN")
        self.check_ready()
        flat = tensor.reshape(-1)
        x = flat.double()  # exact for every gradient dtype
        magnitude = x.abs()
        step = 2.0 ** step_exponent(self.error_bound)
        q = torch.floor(magnitude / step)  # inf where |x| / step overflows: those go in full
        full = ~(magnitude < 1)  # NaN too
        kept = ~full & (magnitude >= self.error_bound)
        eight = kept & (q < 2**7)
        sixteen = kept & ~eight & (q < 2**15)
        full |= kept & ~eight & ~sixteen
        tags = eight.to(torch.uint8) * EIGHT_BITS + sixteen.to(torch.uint8) * SIXTEEN_BITS + full.to(torch.uint8) * FULL
        signed = torch.where(x < 0, -q, q)
        payload = [pack_tags(tags), flat[full], signed[sixteen].to(torch.int16), signed[eight].to(torch.int8)]
        return payload, InceptionnContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device, step)

    def decompress(self, payload: Payload, ctx: InceptionnContext) -> torch.Tensor:
        packed, full, q16, q8 = payload
        tags = unpack_tags(packed, ctx.numel)
        out = torch.zeros(ctx.numel, dtype=torch.float64, device=packed.device)
        out[tags == EIGHT_BITS] = q8.double() * ctx.step
        out[tags == SIXTEEN_BITS] = q16.double() * ctx.step
        decoded = out.to(ctx.dtype)
        decoded[tags == FULL] = full
        return decoded.view(ctx.shape)

    def recommended_memory(self) -> Memory:
        return Residual()
