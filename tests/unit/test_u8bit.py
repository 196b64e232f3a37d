"""U8bit (``compressors/u8bit.py``, Dettmers 2015) against its independent reference
(``tests/reference_compressors.py``), payload and decoded values bit for bit, in the four gradient
dtypes and on contents that reach every branch; the dynamic tree table is the paper's; each value
goes to the nearest magnitude times the scale, a midpoint to the smaller one."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import U8bit
from grace_legacy.compressors.kernels import compiled, u8bit_passes
from grace_legacy.compressors.u8bit import dynamic_tree_table
from tests.reference_compressors import (
    CONTENTS,
    DTYPES,
    U8bitReference,
    assert_matches_reference,
    awkward_gradient,
    dynamic_tree_magnitudes,
)

PAIRS = {
    "U8bit": (U8bit, U8bitReference),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_payload_and_decoded_values_equal_the_reference(pair, content, dtype):
    make, make_reference = PAIRS[pair]
    assert_matches_reference(make(), make_reference(), content, dtype, pair)


def test_the_dynamic_tree_table_is_the_papers():
    table = dynamic_tree_table()
    assert table == dynamic_tree_magnitudes()
    assert len(table) == 128 and table == sorted(table) and len(set(table)) == 128
    assert float(table[1]) == 5.5e-7 and float(table[-1]) == 0.99296875
    # 2**(6 - z) magnitudes between 10**-(z+1) and 10**-z, evenly spaced in each.
    for z in range(7):
        decade = [t for t in table if 10 ** -(z + 1) < t < 10**-z]
        assert len(decade) == 2 ** (6 - z)
        assert len({b - a for a, b in zip(decade, decade[1:], strict=False)}) <= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_u8bit_decodes_to_the_nearest_magnitude_times_the_scale(dtype):
    x = awkward_gradient("wide", 2000, dtype, seed=3)
    payload, ctx = U8bit().compress(x, "w")
    scale = x.abs().max().double()
    table = torch.tensor([float(t) for t in dynamic_tree_table()], dtype=torch.float64)
    nearest = (x.double().abs().unsqueeze(1) / scale - table).abs().argmin(1)
    decoded_code = payload[1] & 127
    # Rounding |x| / s to the work dtype may only move a value sitting on a midpoint.
    assert (decoded_code.long() - nearest).abs().max() <= 1
    assert (decoded_code.long() != nearest).float().mean() < 1e-3
    assert torch.equal(payload[1] >= 128, x < 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_u8bit_sends_a_value_on_a_midpoint_to_the_smaller_magnitude(dtype):
    table = dynamic_tree_table()
    midpoints = torch.tensor([float((a + b) / 2) for a, b in zip(table, table[1:], strict=False)],
                             dtype=torch.float64).to(dtype)
    x = torch.cat([torch.ones(1, dtype=dtype), midpoints])  # the scale is 1: |x| / s is the midpoint itself
    payload, _ = U8bit().compress(x, "w")
    assert payload[1][1:].tolist() == list(range(127))
    assert payload[1][1:].tolist() == U8bitReference().compress(x, "w")[0][1][1:].tolist()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_compiled_passes_give_the_torch_formulas_bits(dtype, threads, monkeypatch):
    """The codes and the decoded values of the compiled loops equal the tensor formulas other devices
    run, bit for bit, on one thread and by blocks on two: signed zeros, values on and beside every
    midpoint, subnormals, and the scales that make every ratio non-finite (zero, inf, NaN)."""
    monkeypatch.setattr(compiled, "PER_THREAD", 1)  # several blocks on two threads at this size
    table = dynamic_tree_table()
    midpoints = torch.tensor([float((a + b) / 2) for a, b in zip(table, table[1:], strict=False)],
                             dtype=torch.float64).to(dtype)
    beside = torch.cat([midpoints, torch.nextafter(midpoints, torch.ones_like(midpoints)),
                        torch.nextafter(midpoints, torch.zeros_like(midpoints))])
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, torch.finfo(dtype).tiny / 4], dtype=dtype)
    x = torch.cat([beside, -beside, special, torch.randn(3 * compiled.BLOCK + 7, dtype=dtype)])
    table_values = torch.tensor([float(t) for t in table], dtype=torch.float64).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for scale in (torch.tensor(1.0, dtype=dtype), x.abs().amax(), torch.tensor(0.0, dtype=dtype),
                      torch.tensor(float("inf"), dtype=dtype), torch.tensor(float("nan"), dtype=dtype)):
            codes = u8bit_passes.codes(x, scale, midpoints)
            assert torch.equal(codes, u8bit_passes.codes_reference(x, scale, midpoints)), scale
            values = u8bit_passes.decoded(codes, scale, table_values)
            reference = u8bit_passes.decoded_reference(codes, scale, table_values)
            assert values.view(-1).numpy().tobytes() == reference.numpy().tobytes(), scale
    finally:
        torch.set_num_threads(before)
