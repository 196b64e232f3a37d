"""The checks every layer shares (``runtime/validation.py``): the one-pass non-finite flag answers
as ``~torch.isfinite(x).all()`` does, for views and empty tensors too; and an integer parameter
refuses a fraction whose float happens to be an integer (found by the fuzzer)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy.runtime.validation import nonfinite_flag

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIALS = [float("nan"), float("inf"), float("-inf")]


@given(shape=st.lists(st.integers(0, 40), max_size=3), dtype=st.sampled_from(DTYPES),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=3),
       scale=st.sampled_from([1e-30, 1.0, 1e4, 1e30]), seed=st.integers(0, 2**16))
@settings(max_examples=300, deadline=None)
def test_nonfinite_flag_answers_as_isfinite_all(shape, dtype, specials, scale, seed):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)
    flat = x.view(-1)
    for position, value in specials:
        if flat.numel():
            flat[position % flat.numel()] = value
    flag = nonfinite_flag(x)
    assert flag.dtype == torch.bool and flag.dim() == 0
    assert bool(flag) == (not bool(torch.isfinite(x).all()))


def test_nonfinite_flag_of_a_view_and_of_an_empty_tensor():
    x = torch.ones(4, 5)
    x[3, 0] = float("nan")
    assert not nonfinite_flag(x[:3])
    assert nonfinite_flag(x.t()[0])
    assert not nonfinite_flag(torch.empty(0, 3))


def test_an_integer_parameter_refuses_a_fraction_whose_float_is_an_integer():
    """Found by the fuzzer: float(Fraction(2**53 + 1, 2)) rounds to the integer 2**52."""
    from fractions import Fraction

    from grace_legacy import PowerSGD

    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=Fraction(2**53 + 1, 2))
    assert PowerSGD(rank=Fraction(8, 2)).value == 4
