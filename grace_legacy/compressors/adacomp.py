"""AdaComp: adaptive residual gradient compression, by bins."""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy.compressors.entries import OwnFeedback
from grace_legacy.compressors.kernels import accumulating
from grace_legacy.compressors.kernels.sign_passes import accumulator_dtype
from grace_legacy.compressors.sparse import SparseContext, index_dtype
from grace_legacy.core.compressor import Payload, Tunable
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.traits import Traits
from grace_legacy.runtime.validation import check_gradient

BIN_SIZE = ScheduledParameter("bin_size", low=1, integer=True)


class AdaComp(OwnFeedback, Tunable):
    """AdaComp (Chen et al., AAAI 2018, "AdaComp: adaptive residual gradient compression for
    data-parallel distributed training"). Per tensor, a residue ``R`` (0 at first) of what was not
    sent; each step, with ``g`` the gradient, ``G = R + g`` and ``H = G + g`` (the residue plus
    twice the gradient). The flattened tensor is cut into bins of ``L = bin_size`` consecutive
    entries (the last may be shorter); in each bin an entry is sent when

        |H_i| >= max over the bin of |G_j|

    (none where a ``G_j`` is NaN), as its ``G_i``, and leaves ``G_i - G_i`` in the residue (0, NaN
    for an infinity); the others stay, ``R <- G_i``. Busy bins send several entries, quiet ones at
    least their largest ``G``'s entry when the gradient pushes it further, so the rate follows the
    gradient by itself; ``L`` is the only parameter (a schedule may set it: ``Legacy(AdaComp(),
    by="layer", ...)``, as the paper tunes it by layer type). The paper also quantizes the values
    it sends; here they go exact, as in the LEGACY reference.

    The residue is this compressor's own memory (``NoMemory`` with it; another memory is refused:
    its error feedback would add a second residue), kept in float32 for 16-bit gradients (the
    values are sent in the gradient's dtype and what that rounding drops stays in the residue),
    undone with a skipped step and saved by :meth:`state_dict`. Payload ``[values, increasing
    indices]``, its size chosen by the data (gathered with a header), each rank's entries summed
    exactly. On a CPU, one compiled pass (:mod:`~grace_legacy.compressors.kernels.accumulating`)."""

    parameter = BIN_SIZE
    traits = Traits(uniform_payload=False)
    stores = ("residues",)

    def __init__(self, bin_size: int | None = None) -> None:
        super().__init__()
        self._set_value(bin_size)
        self.residues: dict[str, torch.Tensor]

    @property
    def bin_size(self) -> int | None:
        return self.value

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Payload, Any]:
        check_gradient(tensor, "AdaComp")
        self.check_ready()
        flat = tensor.reshape(-1)
        state = accumulator_dtype(tensor.dtype)
        residue = self.residues.get(name)
        if residue is None:
            residue = torch.zeros(flat.numel(), dtype=state, device=tensor.device)
        elif residue.shape != flat.shape or residue.dtype != state:
            raise ValueError(f"AdaComp: tensor {name!r} changed from a {residue.numel()}-entry {residue.dtype} residue "
                             f"to a {tuple(tensor.shape)} {tensor.dtype} gradient")
        indices = index_dtype(flat.numel())
        size = min(self.bin_size, flat.numel())  # a bin longer than the tensor is the tensor
        if accumulating.kernels_apply(residue, flat):
            sent, positions, kept = accumulating.bins_pass(residue.numpy(), flat.numpy(), size,
                                                           accumulating.NUMPY_INDEX[indices])
            values, positions, kept = torch.from_numpy(sent), torch.from_numpy(positions), torch.from_numpy(kept)
        else:
            values, positions, kept = bins(residue, flat.to(state), size, tensor.dtype)
            positions = positions.to(indices)
        self._keep(name, residues=kept)
        ctx = SparseContext(tensor.shape, flat.numel(), tensor.dtype, tensor.device)
        return [values, positions], ctx

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        raise NotImplementedError("AdaComp sends the entries its bins select, so its payload size depends on the "
                                  "gradient's values, not only on the tensor's size")

    def __repr__(self) -> str:
        return f"AdaComp(bin_size={self.bin_size!r})"


def bins(residue: torch.Tensor, grad: torch.Tensor, bin_size: int,
         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdaComp's selection as tensor formulas (any device): ``residue`` and ``grad`` 1-D in the
    state's dtype, the values sent in ``dtype``. ``(values, int64 positions, next residue)``."""
    g = residue + grad
    n = g.numel()
    magnitudes = g.abs()
    padded = torch.nn.functional.pad(magnitudes, (0, -n % bin_size))
    top = padded.view(-1, bin_size).amax(dim=1).repeat_interleave(bin_size)[:n]
    positions = torch.nonzero((g + grad).abs() >= top).reshape(-1)
    chosen = g.index_select(0, positions)
    values = chosen.to(dtype)
    kept = g.index_put((positions,), chosen - values.to(g.dtype))
    return values, positions, kept
