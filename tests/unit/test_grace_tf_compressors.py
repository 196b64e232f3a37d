"""AdaQ, INCEPTIONN, Sketch, U8bit and BF16 against their independent references
(``tests/reference_compressors.py``), payload and decoded values bit for bit, in the four gradient
dtypes, on contents that reach every branch (zeros, ties, subnormals, values of every magnitude,
inf and NaN); and the properties each paper promises."""

from __future__ import annotations

import math

import pytest
import torch

from grace_legacy import BF16, INCEPTIONN, AdaQ, Sketch, U8bit
from grace_legacy.compressors.u8bit import dynamic_tree_table
from tests.reference_compressors import (
    AdaQReference,
    BF16Reference,
    INCEPTIONNReference,
    SketchReference,
    U8bitReference,
    dynamic_tree_magnitudes,
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CONTENTS = ["normal", "zeros", "ties", "tiny", "wide", "nonfinite", "one"]

PAIRS = {
    "U8bit": (U8bit, U8bitReference),
    "Sketch(1)": (lambda: Sketch(1), lambda: SketchReference(1)),
    "Sketch(7)": (lambda: Sketch(7), lambda: SketchReference(7)),
    "Sketch(256)": (lambda: Sketch(256), lambda: SketchReference(256)),
    "INCEPTIONN(2**-10)": (lambda: INCEPTIONN(2**-10), lambda: INCEPTIONNReference(2**-10)),
    "INCEPTIONN(2e-10)": (lambda: INCEPTIONN(2e-10), lambda: INCEPTIONNReference(2e-10)),
    "INCEPTIONN(0.3)": (lambda: INCEPTIONN(0.3), lambda: INCEPTIONNReference(0.3)),
    "INCEPTIONN(5e-324)": (lambda: INCEPTIONN(5e-324), lambda: INCEPTIONNReference(5e-324)),
    "INCEPTIONN(1.0)": (lambda: INCEPTIONN(1.0), lambda: INCEPTIONNReference(1.0)),
    "AdaQ(0.3)": (lambda: AdaQ(0.3, seed=5, min_samples=16), lambda: AdaQReference(0.3, seed=5, min_samples=16)),
    "AdaQ(0.01)": (lambda: AdaQ(0.01, seed=6, sample_ratio=0.5, min_samples=1),
                   lambda: AdaQReference(0.01, seed=6, sample_ratio=0.5, min_samples=1)),
    "AdaQ(0.99)": (lambda: AdaQ(0.99, seed=7), lambda: AdaQReference(0.99, seed=7)),
    "BF16": (BF16, BF16Reference),
}


def gradient(content: str, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    if content == "zeros":
        x.zero_()
    elif content == "ties":
        x = torch.randint(-3, 4, (numel,), generator=g).double() / 4
    elif content == "tiny":
        x *= torch.finfo(dtype).tiny * 3  # subnormals and the smallest normals
    elif content == "wide":
        x *= torch.pow(10.0, torch.randint(-12, 3, (numel,), generator=g).double())
    elif content == "nonfinite":
        x[[1, numel // 2, numel - 2]] = torch.tensor([math.inf, math.nan, -math.inf], dtype=torch.float64)
    elif content == "one":
        x = x[:1]
    return x.to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (what, actual, expected)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_payload_and_decoded_values_equal_the_reference(pair, content, dtype):
    make, make_reference = PAIRS[pair]
    compressor, reference = make(), make_reference()
    for rank in (0, 3):
        compressor.set_rank(rank)
        reference.set_rank(rank)
        for step in range(2):
            x = gradient(content, 301, dtype, seed=10 * rank + step).view(7, 43) if content != "one" else \
                gradient(content, 301, dtype, seed=rank)
            payload, ctx = compressor.compress(x, "layer.weight")
            expected, reference_ctx = reference.compress(x, "layer.weight")
            assert len(payload) == len(expected)
            for i, (part, part_expected) in enumerate(zip(payload, expected, strict=True)):
                assert_same(part, part_expected, f"{pair} rank {rank} step {step}: payload part {i}")
            decoded = compressor.decompress(payload, ctx)
            assert_same(decoded, reference.decompress(expected, reference_ctx), f"{pair}: decoded")
            assert decoded.shape == x.shape and decoded.dtype == dtype


# -- 8-bit approximation -------------------------------------------------------------------------


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
    x = gradient("wide", 2000, dtype, seed=3)
    payload, ctx = U8bit().compress(x, "w")
    scale = x.abs().max().double()
    table = torch.tensor([float(t) for t in dynamic_tree_table()], dtype=torch.float64)
    nearest = (x.double().abs().unsqueeze(1) / scale - table).abs().argmin(1)
    decoded_code = payload[1] & 127
    # Rounding |x| / s to the work dtype may only move a value sitting on a midpoint.
    assert (decoded_code.long() - nearest).abs().max() <= 1
    assert (decoded_code.long() != nearest).float().mean() < 1e-3
    assert torch.equal(payload[1] >= 128, x < 0)


# -- Sketch ------------------------------------------------------------------------------------------


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


# -- INCEPTIONN ------------------------------------------------------------------------------------


@pytest.mark.parametrize("error_bound", [2**-10, 2e-10, 1e-3, 0.3, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inceptionn_keeps_its_error_bound_and_sends_the_rest_whole(error_bound, dtype):
    x = gradient("wide", 5000, dtype, seed=4) * 30
    payload, ctx = INCEPTIONN(error_bound).compress(x, "w")
    decoded = INCEPTIONN(error_bound).decompress(payload, ctx)
    small = x.double().abs() < 1
    assert (decoded.double() - x.double())[small].abs().max() < error_bound
    assert torch.equal(decoded[~small], x[~small])
    tags = payload[0]
    bits = 2 * x.numel() + 8 * payload[1].numel() * x.element_size() + 16 * payload[2].numel() + 8 * payload[3].numel()
    assert tags.numel() == math.ceil(x.numel() / 4) and bits <= 2 * x.numel() + 8 * x.numel() * x.element_size()


def test_inceptionn_picks_the_width_from_the_exponent():
    # Bound 2**-10: dropped below 2**-10, 8 bits up to 2**-3 (exclusive), 16 bits up to 1, full from 1.
    x = torch.tensor([2**-11, 2**-10, 2**-3 - 2**-20, 2**-3, 1 - 2**-20, 1.0, -3.0])
    payload, ctx = INCEPTIONN(2**-10).compress(x, "w")
    tags, full, q16, q8 = payload
    assert [(tags[0].item() >> (2 * i)) & 3 for i in range(4)] + [(tags[1].item() >> (2 * i)) & 3 for i in range(3)] \
        == [0, 1, 1, 2, 2, 3, 3]
    assert q8.tolist() == [1, 127] and q16.tolist() == [128, 1023] and full.tolist() == [1.0, -3.0]


# -- AdaQ ------------------------------------------------------------------------------------------


def test_adaq_sends_about_its_ratio_of_each_sign_and_their_means():
    x = torch.randn(200_000, dtype=torch.float64)
    compressor = AdaQ(0.05, seed=1)
    payload, ctx = compressor.compress(x, "w")
    indices, means = payload
    positive, negative = indices[indices >= 0].long(), (-1 - indices[indices < 0]).long()
    for chosen, side in ((positive, x > 0), (negative, x < 0)):
        share = chosen.numel() / int(side.sum())
        assert 0.03 < share < 0.07
        # The chosen entries are exactly the side's entries at or above the smallest chosen magnitude.
        bound = x[chosen].abs().min()
        assert torch.equal(torch.sort(chosen).values, (side & (x.abs() >= bound)).nonzero().view(-1))
    torch.testing.assert_close(means, torch.stack([x[positive].mean(), x[negative].mean()]), rtol=1e-12, atol=0)


def test_adaq_takes_the_exact_top_share_of_a_side_it_does_not_sample():
    x = torch.randn(100, dtype=torch.float64)
    payload, _ = AdaQ(0.2, min_samples=1000).compress(x, "w")
    positive = payload[0][payload[0] >= 0].long()
    k = max(1, math.floor(0.2 * int((x > 0).sum())))
    assert set(positive.tolist()) == set(torch.topk(torch.where(x > 0, x, 0), k).indices.tolist())


def test_adaq_draws_differ_by_rank_step_and_name_and_repeat_alike():
    x = torch.randn(50_000)
    first, again = AdaQ(0.1, seed=3), AdaQ(0.1, seed=3)
    outcomes = {tuple(first.compress(x, "w")[0][0].tolist()[:50]) for _ in range(3)}
    assert len(outcomes) == 3
    assert torch.equal(again.compress(x, "w")[0][0], AdaQ(0.1, seed=3).compress(x, "w")[0][0])
    other = AdaQ(0.1, seed=3)
    other.set_rank(1)
    assert not torch.equal(other.compress(x, "w")[0][0], AdaQ(0.1, seed=3).compress(x, "w")[0][0])


@pytest.mark.parametrize("build,message", [
    (lambda: AdaQ(0.1, sample_ratio=0), "sample_ratio must be a number in"),
    (lambda: AdaQ(0.1, sample_ratio=1.5), "sample_ratio must be a number in"),
    (lambda: AdaQ(0.1, min_samples=0), "min_samples must be an integer"),
    (lambda: AdaQ(0.1, min_samples=2.5), "min_samples must be an integer"),
])
def test_adaq_refuses_bad_sampling_arguments(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("build", [lambda: AdaQ(0.1, seed="1"), lambda: AdaQ(0.1, sample_ratio="0.1"),
                                   lambda: AdaQ(0.1, min_samples=[3])])
def test_adaq_refuses_arguments_of_the_wrong_type(build):
    with pytest.raises(TypeError):
        build()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_u8bit_sends_a_value_on_a_midpoint_to_the_smaller_magnitude(dtype):
    table = dynamic_tree_table()
    midpoints = torch.tensor([float((a + b) / 2) for a, b in zip(table, table[1:], strict=False)],
                             dtype=torch.float64).to(dtype)
    x = torch.cat([torch.ones(1, dtype=dtype), midpoints])  # the scale is 1: |x| / s is the midpoint itself
    payload, _ = U8bit().compress(x, "w")
    assert payload[1][1:].tolist() == list(range(127))
    assert payload[1][1:].tolist() == U8bitReference().compress(x, "w")[0][1][1:].tolist()
