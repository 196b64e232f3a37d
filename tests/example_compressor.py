"""The worked example of docs/IMPLEMENTING.md: a compressor written outside the library, in one
file, with only the public interface. The registry (``tests/registry.py``) holds its entry, so
the contract tests, the fuzzer and the horovodrun cases exercise it like any built-in one.

``Int8Linear(levels)`` rounds each entry to the nearest of ``2 * levels + 1`` evenly spaced values
between ``-max|x|`` and ``max|x|`` and sends the codes as int8 with the one scale: one byte an
element plus four. Deterministic, so unlike QSGD it is biased, and its recommended memory is
error feedback (``Residual``). Each rank has its own scale, so payloads are gathered, not summed.
"""

from __future__ import annotations

from typing import Any

import torch

from grace_legacy import Memory, Residual, ScheduledParameter
from grace_legacy.core.compressor import Tunable
from grace_legacy.runtime.validation import check_gradient

#: The parameter a schedule may set: whole levels that fit an int8 code. No value means dense, so
#: ``Legacy(Int8Linear(), values=[None, 16])`` sends the first size group uncompressed.
LEVELS = ScheduledParameter("levels", low=1, high=127, integer=True)


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision gradients are scaled in float32 (their max / levels may underflow)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Int8Linear(Tunable):
    """Deterministic linear quantization: payload ``[scale (1 element), codes (n int8)]``."""

    parameter = LEVELS

    def __init__(self, levels: int | None = None) -> None:
        super().__init__()
        self._set_value(levels)  # checks the range; None leaves it for a schedule to set

    @property
    def levels(self) -> int | None:
        return self.value

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], Any]:
        check_gradient(tensor, "Int8Linear")
        self.check_ready()
        x = tensor.reshape(-1).to(_scale_dtype(tensor.dtype))
        scale = x.abs().max() / self.levels
        # An all-zero tensor has scale 0: every code is 0 (the division's NaN is discarded).
        codes = torch.where(scale > 0, torch.round(x / scale), 0.0).clamp_(-self.levels, self.levels)
        return [scale.reshape(1), codes.to(torch.int8)], (tensor.shape, tensor.dtype)

    def decompress(self, payload: list[torch.Tensor], ctx: Any) -> torch.Tensor:
        shape, dtype = ctx
        scale, codes = payload
        return (codes.to(scale.dtype) * scale).to(dtype).view(shape)

    def payload_spec(self, numel: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
        return [(1, _scale_dtype(dtype)), (numel, torch.int8)]

    def recommended_memory(self) -> Memory:
        return Residual()

    # The default repr, Int8Linear(levels=...), already names the only argument: the parameter.
