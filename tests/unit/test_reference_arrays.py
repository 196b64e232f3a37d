"""The array forms of the independent references (``tests/reference_arrays.py``), which the tests
use on every tensor, send the payload bits and decode to the values of the element-by-element
definitions (``compress_by_element`` in ``tests/reference_compressors.py``), on small drawn tensors
of every gradient dtype: NaN, infinities, signed zeros, ties, subnormals, values on the 8-bit
table's midpoints and on powers of two."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import bits
from tests.reference_arrays import sequential_sum
from tests.reference_compressors import (
    DTYPES,
    AdaQReference,
    INCEPTIONNReference,
    SketchReference,
    U8bitReference,
    dynamic_tree_magnitudes,
)
from tests.registry import fuzz_settings

_TABLE = dynamic_tree_magnitudes()
_SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1.0, -1.0, 0.5, 2.0**-10, 2.0**-20, 3 * 2.0**-11,
            2e-10, 5e-324, 1e-300, 1e-45, 6e-8, 1e-40, 65504.0, 0.25, -0.25, 0.125,
            # INCEPTIONN's form boundaries 2**(L+7) and 2**(L+15) for its bounds below, and just under.
            *(v for e in range(-40, 0) for v in (2.0**e, -math.nextafter(2.0**e, 0)))]

elements = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1.0, 1.0),
    st.sampled_from(_SPECIAL),
    st.integers(-3, 3).map(lambda k: k / 4),  # ties
    st.floats(-1e-6, 1e-6),
)


_MIDPOINTS = [float((a + b) / 2) for a, b in zip(_TABLE, _TABLE[1:], strict=False)]


@st.composite
def gradients(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    values = draw(st.lists(elements, min_size=1, max_size=40))
    if draw(st.booleans()):
        # |x| / max |x| on the 8-bit table's midpoints (as rounded to the dtype), where ties go down.
        scale = draw(st.sampled_from([1.0, 2.0**-7, 8.0]))
        values = [scale, *(scale * m for m in draw(st.lists(st.sampled_from(_MIDPOINTS), min_size=1, max_size=20)))]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    shape = draw(st.sampled_from([(len(values),), (1, len(values)), (len(values), 1)]))
    return x.reshape(shape)


REFERENCES = st.one_of(
    st.just(U8bitReference()),
    st.sampled_from([1, 2, 3, 7, 16, 64, 256]).map(SketchReference),
    st.sampled_from([2.0**-10, 2e-10, 2.0**-20, 0.3, 5e-324, 1e-300, 1.0, 3.0, 6e-8]).map(INCEPTIONNReference),
)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bits, but any NaN for a NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (what, a, b)
    if a.is_floating_point():
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)), (what, a, b)
        a, b = bits(a[~nan]), bits(b[~nan])
    assert torch.equal(a, b), (what, a, b)


def _both(array_form, by_element, x: torch.Tensor, label: str) -> None:
    payload, ctx = array_form.compress(x, "w")
    expected, expected_ctx = by_element.compress_by_element(x, "w")
    assert len(payload) == len(expected), label
    for i, (part, part_expected) in enumerate(zip(payload, expected, strict=True)):
        _same(part, part_expected, f"{label}: payload part {i}")
    _same(array_form.decompress(payload, ctx), by_element.decompress_by_element(expected, expected_ctx),
          f"{label}: decoded")


@fuzz_settings(400)
@given(reference=REFERENCES, x=gradients())
def test_the_array_forms_equal_the_element_by_element_definitions(reference, x):
    _both(reference, reference, x, type(reference).__name__)


@fuzz_settings(200)
@given(x=gradients(), ratio=st.sampled_from([0.01, 0.3, 0.5, 0.99, 1.0]),
       sample_ratio=st.sampled_from([1e-9, 0.1, 0.5, 1.0]), min_samples=st.integers(1, 50),
       rank=st.integers(0, 3))
def test_adaq_array_form_equals_its_definition(x, ratio, sample_ratio, min_samples, rank):
    # Two instances, as each compress takes the next step's generator.
    array_form, by_element = (AdaQReference(ratio, seed=3, sample_ratio=sample_ratio, min_samples=min_samples)
                              for _ in range(2))
    array_form.set_rank(rank)
    by_element.set_rank(rank)
    for step in range(2):
        _both(array_form, by_element, x, f"AdaQ step {step}")


@fuzz_settings(200)
@given(values=st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(_SPECIAL)),
                       max_size=60))
def test_the_sequential_sum_adds_in_order(values):
    total = 0.0
    for v in values:
        total += v
    got = sequential_sum(torch.tensor(values, dtype=torch.float64).numpy())
    same_bits = got == total and math.copysign(1, got) == math.copysign(1, total)
    assert same_bits or (math.isnan(got) and math.isnan(total))
