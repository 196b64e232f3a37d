"""Packing boolean tensors 8 to a byte: element ``i`` of the flattened input is bit ``i % 8`` (least
significant first) of byte ``i // 8``, as ``numpy.packbits(..., bitorder="little")``; the unused high
bits of the last byte are zero, so equal inputs pack to equal bytes. On the tensor's own device
(numpy's views on the CPU's own path, :func:`grace_legacy.runtime.paths.cpu_path`).
"""

from __future__ import annotations

import numpy as np
import torch

from grace_legacy.runtime import paths

BITS_PER_BYTE = 8


def packed_length(numel: int) -> int:
    """Bytes that ``numel`` bits take: ``ceil(numel / 8)``."""
    if numel < 0:
        raise ValueError(f"packed_length: numel must be >= 0, got {numel}")
    return -(-numel // BITS_PER_BYTE)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(BITS_PER_BYTE, dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a ``bool`` tensor of any shape (flattened) into a 1-d ``uint8`` tensor of
    ``ceil(numel / 8)`` bytes."""
    if not isinstance(bits, torch.Tensor) or bits.dtype != torch.bool:
        got = bits.dtype if isinstance(bits, torch.Tensor) else type(bits).__name__
        raise TypeError(f"pack_bits: expected a bool tensor, got {got}")
    if paths.cpu_path(bits):
        if bits.numel() == 0:  # numpy's empty result can carry strides torch cannot view
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(np.packbits(bits.reshape(-1).numpy(), bitorder="little"))
    return _pack_bits_torch(bits)


def _pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    flat = bits.reshape(-1).to(torch.uint8)
    pad = packed_length(flat.numel()) * BITS_PER_BYTE - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # Each byte's 8 bits are distinct powers of two, so their sum is their OR and fits in uint8.
    return (flat.view(-1, BITS_PER_BYTE) << _shifts(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``packed`` of shape ``(..., ceil(numel / 8))`` gives a
    ``bool`` tensor of shape ``(..., numel)``. Leading dimensions unpack several payloads at once
    (one row per rank)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(f"unpack_bits: expected a uint8 tensor, got {got}")
    if packed.dim() == 0 or packed.shape[-1] != packed_length(numel):
        raise ValueError(f"unpack_bits: {numel} bits need {packed_length(numel)} bytes in the last "
                         f"dimension, got shape {tuple(packed.shape)}")
    if paths.cpu_path(packed) and numel > 0:
        spread = np.unpackbits(packed.numpy(), axis=-1, count=numel, bitorder="little")
        return torch.from_numpy(spread).view(torch.bool)
    return _unpack_bits_torch(packed, numel)


def _unpack_bits_torch(packed: torch.Tensor, numel: int) -> torch.Tensor:
    spread = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return spread.reshape(*packed.shape[:-1], -1)[..., :numel].bool()
