"""Comparing floats bit for bit: -0.0 differs from 0.0, and each NaN keeps its sign and payload."""

import torch

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s entries, flattened, as same-width integers."""
    return t.reshape(-1).view(_SAME_WIDTH_INT[t.element_size()])
