"""Sketch (``compressors/sketch.py``, SketchML's quantile buckets) against its independent
reference (``tests/reference_compressors.py``), payload and decoded values bit for bit, in the four
gradient dtypes and on contents that reach every branch; buckets of equal counts, ordered, each
keeping its sum."""

from __future__ import annotations

import pytest
import torch

from grace_legacy import Sketch
from tests.reference_compressors import CONTENTS, DTYPES, SketchReference, assert_matches_reference

PAIRS = {
    "Sketch(1)": (lambda: Sketch(1), lambda: SketchReference(1)),
    "Sketch(7)": (lambda: Sketch(7), lambda: SketchReference(7)),
    "Sketch(256)": (lambda: Sketch(256), lambda: SketchReference(256)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_payload_and_decoded_values_equal_the_reference(pair, content, dtype):
    make, make_reference = PAIRS[pair]
    assert_matches_reference(make(), make_reference(), content, dtype, pair)


@pytest.mark.parametrize("quantiles", [1, 2, 16, 256])
def test_sketch_buckets_hold_equal_counts_and_keep_each_buckets_sum(quantiles):
    x = torch.randn(10_000, dtype=torch.float64)
    payload, ctx = Sketch(quantiles).compress(x, "w")
    counts = torch.bincount(payload[1].long(), minlength=quantiles)
    assert counts.sum() == 10_000 and counts.max() - counts.min() <= 1
    decoded = Sketch(quantiles).decompress(payload, ctx)
    torch.testing.assert_close(decoded.sum(), x.sum(), rtol=1e-12, atol=1e-9)
    # Buckets are ordered: every value of bucket b is below every value of bucket b + 1.
    bucket = payload[1].long()
    for b in range(quantiles - 1):
        assert x[bucket == b].max() < x[bucket == b + 1].min()
