"""Bit packing for the 1-bit compressors (``compressors/kernels/bits.py``): 8 signs to a byte,
least significant first, as ``numpy.packbits(..., bitorder="little")``, for every length and shape;
the torch path other devices take gives the same bytes; empty input and wrong input."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy.compressors.kernels.bits import (
    _pack_bits_torch,
    _unpack_bits_torch,
    pack_bits,
    packed_length,
    unpack_bits,
)


def reference_pack(bits: torch.Tensor) -> np.ndarray:
    return np.packbits(bits.reshape(-1).numpy(), bitorder="little")


shapes = st.lists(st.integers(1, 6), max_size=4).map(tuple)


@pytest.mark.parametrize("n", range(1, 71))
def test_pack_round_trips_every_length_and_matches_numpy_little_endian(n):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(n / 8),) == (packed_length(n),)
    assert np.array_equal(packed.numpy(), reference_pack(bits))
    assert torch.equal(unpack_bits(packed, n), bits)
    if n % 8:  # the unused high bits of the last byte are zero
        assert packed[-1].item() < 2 ** (n % 8)


@given(shape=shapes, seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_pack_round_trips_random_shapes(shape, seed):
    bits = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.5
    packed = pack_bits(bits)
    n = bits.numel()
    assert packed.numel() == -(-n // 8)
    assert torch.equal(unpack_bits(packed, n).view(shape), bits)


@given(shape=shapes, seed=st.integers(0, 2**16), rows=st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_the_torch_path_other_devices_take_packs_as_the_cpu_path(shape, seed, rows):
    """On CPU the bits go through numpy; on other devices through torch: same bytes, same bits,
    from non-contiguous input too (a transposed tensor, rows sliced out of a wider gather)."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.rand(shape, generator=generator) > 0.5
    for source in (bits, bits.t() if bits.dim() == 2 else bits):
        packed = pack_bits(source)
        assert torch.equal(packed, _pack_bits_torch(source))
        assert torch.equal(unpack_bits(packed, source.numel()), _unpack_bits_torch(packed, source.numel()))
    n = bits.numel()
    width = packed_length(n)
    gathered = torch.randint(0, 256, (rows, width + 5), dtype=torch.uint8, generator=generator)
    stacked = gathered[:, 3:3 + width]  # a strided view, as wire.unpack_stacked hands over
    assert torch.equal(unpack_bits(stacked, n), _unpack_bits_torch(stacked, n))


def test_empty_bits_pack_to_no_bytes_and_back():
    packed = pack_bits(torch.zeros(0, dtype=torch.bool))
    assert packed.shape == (0,) and packed.dtype == torch.uint8
    assert unpack_bits(packed, 0).shape == (0,)
    assert unpack_bits(torch.zeros(3, 0, dtype=torch.uint8), 0).shape == (3, 0)


def test_unpack_rows_unpacks_each_rank_independently():
    rows = [torch.tensor([True, False, True] * 4)[:11], torch.tensor([False] * 10 + [True])]
    packed = torch.stack([pack_bits(r) for r in rows])
    assert torch.equal(unpack_bits(packed, 11), torch.stack(rows))


def test_pack_and_unpack_refuse_wrong_input():
    with pytest.raises(TypeError, match="bool tensor"):
        pack_bits(torch.ones(3))
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.ones(2, dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="9 bits need 2 bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        packed_length(-1)
