"""CAT: communication-aware Top-k, whose ``k`` maximises the squared norm sent per unit of a
communication-cost model."""

from __future__ import annotations

import math
from typing import Any

import torch

from grace_legacy.compressors.entries import EntrySparsifier
from grace_legacy.compressors.kernels.selection import top_k_first
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.core.compressor import Payload
from grace_legacy.core.memory import Memory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.traits import Traits
from grace_legacy.memories.residual import Residual
from grace_legacy.runtime.validation import check_gradient, required

#: Entries of largest magnitude looked at first, at least (see :meth:`CAT.kept`).
FIRST_LOOK = 1024
#: The cost model's arguments and their ranges.
C0 = ScheduledParameter("c0", low=0.0, low_inclusive=False)
C1 = ScheduledParameter("c1", low=0.0)
PACKET_BITS = ScheduledParameter("packet_bits", low=1, integer=True)


class CAT(EntrySparsifier):
    """Communication-aware Top-k (Khirirat et al., AAAI 2021, "A flexible framework for
    communication-efficient machine learning"; the LEGACY reference's ``GlobalCATReducer``): each
    rank, each step, sends the ``T`` entries of largest magnitude of the whole model's gradient
    (the step's gradients end to end, as :class:`GlobalTopK`), with ``T`` chosen to maximise the
    descent it buys per unit of communication: the share of the squared norm it sends,
    ``S(T) = sum of the T largest x_i^2``, over the cost of sending it.

    The cost is the paper's packet model: an entry takes ``b`` bits (its value and its index as
    this payload sends them: 64 for fp32 values with int32 indices), a packet carries
    ``tau = max(1, packet_bits // b)`` whole entries, and a message of ``m`` packets costs
    ``c0 * m + c1`` (``c0`` per packet, ``c1`` per message). ``T`` is then a whole number of packets,
    ``T_m = min(m * tau, n)``, and ``m`` is the smallest maximiser of ``S(T_m) / (c0 m + c1)``
    (``S`` summed in float64 in the order of decreasing magnitude, ties to the lower position, NaN
    and infinity first). The defaults are the reference's: ``c0 = 1``, ``c1 = 60``,
    ``packet_bits = 1460`` (22 fp32 entries a packet); its comment gives ``c0 = 576``, ``c1 = 64``,
    ``packet_bits = 512`` as the paper's. The reference's cost, ``c0 * T b / packet_bits + c1``,
    counts fractions of packets and ``ceil(log2 n)`` index bits; here packets are whole and an
    index costs what it costs on the wire.

    ``S(T_m)`` grows concavely in ``m`` and the cost linearly, so the ratio rises to its maximum
    and then falls: :meth:`kept` sorts only the largest entries, a few times more than the
    maximiser needs (four packets, at least 1024 entries, then eight times more while the ratio
    has not yet turned down), never the whole model.

    Payload ``[values, increasing indices]`` of ``T`` entries (``T`` differs between ranks: gathered
    with a size header, its size not predictable from the shape), each rank's entries summed
    exactly; ``Residual`` recommended (the reference keeps no error feedback)."""

    # NaN and infinity sort first, and T >= 1.
    traits = Traits(sends_entries=True, spans_step=True, uniform_payload=False, delivers_nonfinite=True)

    def __init__(self, c0: float = 1.0, c1: float = 60.0, packet_bits: int = 1460) -> None:
        super().__init__()
        self.c0 = required(C0, c0, "CAT")
        self.c1 = required(C1, c1, "CAT")
        self.packet_bits = required(PACKET_BITS, packet_bits, "CAT")

    def per_packet(self, numel: int, dtype: torch.dtype) -> int:
        """``tau``: the whole entries of a ``numel``-entry tensor of ``dtype`` one packet carries."""
        entry_bits = 8 * (dtype.itemsize + index_dtype(numel).itemsize)
        return max(1, self.packet_bits // entry_bits)

    def kept(self, flat: torch.Tensor) -> torch.Tensor:
        """The increasing positions of the ``T`` entries of the 1-D ``flat`` that CAT sends."""
        n = flat.numel()
        tau = self.per_packet(n, flat.dtype)
        look = min(n, max(4 * tau, FIRST_LOOK))
        while True:
            positions = torch.arange(n, device=flat.device) if look == n else top_k_first(flat, look)
            magnitudes = flat.index_select(0, positions).abs()
            order = torch.sort(magnitudes, descending=True, stable=True).indices
            sums = magnitudes.index_select(0, order).double().square().cumsum(0)
            # Whole packets only, but for the last one of the tensor: a packet cut short by ``look``
            # would count too little of it.
            whole = math.ceil(look / tau) if look == n else max(1, look // tau)
            packets = torch.arange(1, whole + 1, device=flat.device, dtype=torch.float64)
            ends = (packets.long() * tau).clamp_(max=look) - 1
            ratios = sums.index_select(0, ends) / (self.c0 * packets + self.c1)
            best = int(torch.argmax(ratios))
            settled = look == n or not math.isfinite(float(sums[0])) or float(sums[-1]) == 0.0 or (
                best + 1 < ratios.numel() and bool(ratios[best + 1] < ratios[best]))
            if settled:
                count = int(ends[best]) + 1
                return positions.index_select(0, order[:count]).sort().values
            look = min(n, 8 * look)

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "CAT")
        flat = tensor.reshape(-1)
        indices = self.kept(flat)
        ctx = SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        return [flat.index_select(0, indices), indices.to(index_dtype(flat.numel()))], ctx

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        raise NotImplementedError(
            "CAT chooses how many entries to send from the gradient's values, so its payload size cannot be "
            "predicted from the tensor's size (budget matching and the planner need a fixed size: GlobalTopK)")

    def recommended_memory(self) -> Memory:
        return Residual()

    def __repr__(self) -> str:
        return f"CAT(c0={self.c0!r}, c1={self.c1!r}, packet_bits={self.packet_bits!r})"
