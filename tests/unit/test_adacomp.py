"""AdaComp (``compressors/adacomp.py``, Chen et al. 2018) against its independent reference
(``tests/reference_sparsifiers.py``), payload, decoded values and residue bit for bit over steps,
in the four gradient dtypes and on awkward contents; its compiled pass equal to its tensor
formulas at any thread count; its bin size, memory and state."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import AdaComp, Grace, NoMemory, Residual
from tests.helpers import on_both_cpu_paths
from tests.reference_compressors import CONTENTS, DTYPES, assert_matches_reference
from tests.reference_sparsifiers import AdaCompReference

#: Every content and dtype at bins of 7; a bin of one entry and one longer than the tensor on a few.
REFERENCE_CASES = [(7, content, dtype) for content in CONTENTS for dtype in DTYPES] + [
    (size, content, torch.float32) for size in (1, 1000) for content in ("normal", "ties")]


@pytest.mark.parametrize(("bin_size", "content", "dtype"), REFERENCE_CASES, ids=str)
def test_payload_and_decoded_values_equal_the_reference(bin_size, content, dtype):
    compressor, reference = AdaComp(bin_size), AdaCompReference(bin_size)
    assert_matches_reference(compressor, reference, content, dtype, f"AdaComp({bin_size})")
    if content != "nonfinite":  # a skipped step; its residue is undone, not compared
        for key, residue in compressor.residues.items():
            expected = torch.tensor([float(r) for r in reference.residues[key]], dtype=residue.dtype)
            assert torch.equal(residue, expected), key


@pytest.mark.parametrize(("dtype", "threads"), [(torch.float32, 2), (torch.float64, 1)], ids=str)
def test_the_compiled_pass_is_the_tensor_formulas_at_any_thread_count(dtype, threads):
    def steps() -> list:
        compressor, out = AdaComp(50), []
        for step in range(3):
            g = torch.randn(700_003, generator=torch.Generator().manual_seed(step), dtype=dtype)
            payload, _ = compressor.compress(g, "w")
            out.append([*payload, compressor.residues["w"]])
        return out

    for got, want in zip(*on_both_cpu_paths(threads, steps), strict=True):
        for part, expected in zip(got, want, strict=True):
            assert part.dtype == expected.dtype and torch.equal(part, expected)


def test_with_no_residue_an_entry_goes_when_it_reaches_half_its_bins_largest():
    # H = 2 g: bins [1.0, 0.4, -0.6] (largest 1.0) and [0.1, 0.0, -0.2] (largest 0.2, which 2 * 0.1 reaches).
    g = torch.tensor([1.0, 0.4, -0.6, 0.1, 0.0, -0.2])
    compressor = AdaComp(3)
    payload, _ = compressor.compress(g, "w")
    assert payload[1].tolist() == [0, 2, 3, 5]
    assert torch.equal(payload[0], g[[0, 2, 3, 5]])
    assert torch.equal(compressor.residues["w"], torch.tensor([0.0, 0.4, 0.0, 0.0, 0.0, 0.0]))


def test_a_bin_longer_than_the_tensor_is_the_tensor():
    g = torch.randn(10)
    assert torch.equal(AdaComp(10**30).compress(g, "w")[0][1], AdaComp(10).compress(g, "w")[0][1])


def test_it_keeps_its_own_residue_and_refuses_a_second_one():
    assert isinstance(Grace(AdaComp(8)).memory, NoMemory)
    with pytest.raises(ValueError, match="own error feedback"):
        Grace(AdaComp(8), memory=Residual())


@pytest.mark.parametrize("value", [0, -3, 1.5])
def test_bad_bin_sizes_are_refused_by_name(value):
    with pytest.raises(ValueError, match="bin_size"):
        AdaComp(value)
