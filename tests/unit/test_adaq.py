"""AdaQ (``compressors/adaq.py``, Dryden et al. 2016) against its independent reference
(``tests/reference_compressors.py``), payload and decoded values bit for bit, in the four gradient
dtypes and on contents that reach every branch; about its ratio of each sign sent, the exact top
share of an unsampled side, draws by seed, rank, name and step; its sampling arguments checked."""

from __future__ import annotations

import math

import pytest
import torch

from grace_legacy import AdaQ
from tests.reference_compressors import CONTENTS, DTYPES, AdaQReference, assert_matches_reference

PAIRS = {
    "AdaQ(0.3)": (lambda: AdaQ(0.3, seed=5, min_samples=16), lambda: AdaQReference(0.3, seed=5, min_samples=16)),
    "AdaQ(0.01)": (lambda: AdaQ(0.01, seed=6, sample_ratio=0.5, min_samples=1),
                   lambda: AdaQReference(0.01, seed=6, sample_ratio=0.5, min_samples=1)),
    "AdaQ(0.99)": (lambda: AdaQ(0.99, seed=7), lambda: AdaQReference(0.99, seed=7)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_payload_and_decoded_values_equal_the_reference(pair, content, dtype):
    make, make_reference = PAIRS[pair]
    assert_matches_reference(make(), make_reference(), content, dtype, pair)


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
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    first, again = AdaQ(0.1, seed=3), AdaQ(0.1, seed=3)
    # Whole index sets: each step's sample sets its own thresholds, so the sets differ, though
    # their first entries may coincide.
    outcomes = {tuple(first.compress(x, "w")[0][0].tolist()) for _ in range(3)}
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
