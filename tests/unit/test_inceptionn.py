"""INCEPTIONN (``compressors/inceptionn.py``, Li et al. 2018) against its independent reference
(``tests/reference_compressors.py``), payload and decoded values bit for bit, in the four gradient
dtypes and on contents that reach every branch; the error bound holds below 1, the rest is sent
whole; the width follows the exponent."""

from __future__ import annotations

import math

import pytest
import torch

from grace_legacy import INCEPTIONN
from tests.reference_compressors import (
    CONTENTS,
    DTYPES,
    INCEPTIONNReference,
    assert_matches_reference,
    awkward_gradient,
)

PAIRS = {
    "INCEPTIONN(2**-10)": (lambda: INCEPTIONN(2**-10), lambda: INCEPTIONNReference(2**-10)),
    "INCEPTIONN(2e-10)": (lambda: INCEPTIONN(2e-10), lambda: INCEPTIONNReference(2e-10)),
    "INCEPTIONN(0.3)": (lambda: INCEPTIONN(0.3), lambda: INCEPTIONNReference(0.3)),
    "INCEPTIONN(5e-324)": (lambda: INCEPTIONN(5e-324), lambda: INCEPTIONNReference(5e-324)),
    "INCEPTIONN(1.0)": (lambda: INCEPTIONN(1.0), lambda: INCEPTIONNReference(1.0)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("content", CONTENTS)
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_payload_and_decoded_values_equal_the_reference(pair, content, dtype):
    make, make_reference = PAIRS[pair]
    assert_matches_reference(make(), make_reference(), content, dtype, pair)


@pytest.mark.parametrize("error_bound", [2**-10, 2e-10, 1e-3, 0.3, 1.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inceptionn_keeps_its_error_bound_and_sends_the_rest_whole(error_bound, dtype):
    x = awkward_gradient("wide", 5000, dtype, seed=4) * 30
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
