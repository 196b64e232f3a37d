"""Whole-model Top-k (``compressors/global_topk.py``) and its selection rule
(``kernels/selection.top_k_first``): against the independent reference
(``tests/reference_sparsifiers.py``), payload and decoded values bit for bit, in the four gradient
dtypes and on awkward contents; ties to the lower position on both paths, at any size; ``k`` read
from the ratio as written; LEGACY may schedule it by epoch, not by layer."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import GlobalTopK, Legacy
from grace_legacy.compressors.kernels.selection import top_k_first
from grace_legacy.runtime import paths
from tests.reference_compressors import CONTENTS, DTYPES, assert_matches_reference
from tests.reference_sparsifiers import GlobalTopKReference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("content", CONTENTS)
def test_payload_and_decoded_values_equal_the_reference(content, dtype):
    assert_matches_reference(GlobalTopK(0.3), GlobalTopKReference(0.3), content, dtype, "GlobalTopK(0.3)")


def stable_order(flat: torch.Tensor) -> torch.Tensor:
    """The rule written out: positions by a stable sort by magnitude, descending (NaN first)."""
    return torch.sort(flat.abs().double(), descending=True, stable=True).indices


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [50, 300_001])
def test_ties_at_the_kth_magnitude_go_to_the_lower_position(numel, dtype, path):
    # Few distinct magnitudes: the k-th is shared by many entries, on the plain and the compiled
    # selection alike (300 001 entries take the sampled threshold, on several threads).
    g = torch.Generator().manual_seed(numel)
    x = (torch.randint(-6, 7, (numel,), generator=g).double() / 8).to(dtype)
    order = stable_order(x)
    with paths.device_path(path == "device"):
        for k in (1, numel // 100 + 1, numel // 3, numel):
            assert torch.equal(top_k_first(x, k), order[:k].sort().values), (k, dtype)


def test_nan_and_infinity_come_first():
    x = torch.tensor([1.0, float("inf"), -3.0, float("nan"), -float("inf"), 2.0])
    assert top_k_first(x, 1).tolist() == [3]
    assert top_k_first(x, 3).tolist() == [1, 3, 4]


def test_k_is_read_from_the_ratio_as_written():
    # 0.29 * 100 is 28.999... in floating point: the reference's int(ratio * n) keeps 28, the ratio
    # as written 29 (documented).
    payload, _ = GlobalTopK(0.29).compress(torch.randn(100), "w")
    assert payload[0].numel() == 29


def test_legacy_sets_its_ratio_by_epoch_and_refuses_to_by_layer():
    schedule = Legacy(GlobalTopK(), by="epoch", values=[0.5, 0.1], epochs=2)
    assert schedule.traits.spans_step
    schedule.set_epoch(1)
    payload, _ = schedule.compress(torch.randn(1000), "w")
    assert payload[0].numel() == 100
    for by in ("layer", "both"):
        values = [0.1, 0.01] if by == "layer" else [[0.1, 0.01]]
        with pytest.raises(ValueError, match="one selection over every layer"):
            Legacy(GlobalTopK(), by=by, values=values, splits=[100], epochs=1 if by == "both" else None)


def test_the_references_order_by_magnitude_is_its_sorted_definition():
    """The whole-array order the references use (NaN first, decreasing magnitude, ties by
    position) equals the definition written as a Python sort, on values full of ties and extremes."""
    import math
    import random

    from tests.reference_sparsifiers import _by_magnitude

    rng = random.Random(1)
    extremes = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf]
    for _ in range(300):
        values = [rng.choice([*extremes, rng.gauss(0, 1)]) for _ in range(rng.randint(1, 40))]
        definition = sorted(range(len(values)), key=lambda i: (not math.isnan(values[i]),
                                                                 0.0 if math.isnan(values[i]) else -abs(values[i]), i))
        assert _by_magnitude(values) == definition, values
