"""The 1-bit compressors' compiled CPU passes (``compressors/kernels/sign_passes.py``) against the
tensor arithmetic other devices use: the same packed bits as numpy, the same sides' sums, the
same payloads and decoded values over awkward values (signed zeros, subnormals, inf, NaN), and
Signum's momentum step bit for bit."""

import functools
import math
import operator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import Signum
from grace_legacy.compressors.kernels import compiled, sign_passes
from tests.unit.test_bits import reference_pack
from tests.unit.test_signs import all_compressors

AWKWARD = [0.0, -0.0, 1e-45, -3e38, 2.5, -2.5, float("inf"), float("-inf"), float("nan")]


def tensor_way(monkeypatch):
    monkeypatch.setattr(compiled, "ENABLED", False)


@pytest.mark.parametrize("n", range(0, 70))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_sign_packing_matches_numpy(n, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[::5] = -0.0
    assert np.array_equal(sign_passes.pack_nonnegative(x).numpy(), reference_pack(x >= 0))
    packed, up, down, count = sign_passes.pack_and_sum_sides(x)
    assert np.array_equal(packed.numpy(), reference_pack(x >= 0))
    assert count == int((x >= 0).sum())
    assert (up, down) == lane_sums(x.tolist())


def lane_sums(values: list[float]) -> tuple[float, float]:
    """The sides' float64 sums in the order the pass documents: within each block, element ``i``
    into lane ``i % LANES`` of its side, lanes in order, then blocks in order (Python floats are
    float64, and Python adds them one at a time)."""
    up_total = down_total = 0.0
    for start in range(0, len(values), compiled.BLOCK):
        ups, downs = [0.0] * sign_passes.LANES, [0.0] * sign_passes.LANES
        for i, value in enumerate(values[start:start + compiled.BLOCK]):
            if value >= 0:
                ups[i % sign_passes.LANES] += value
            else:
                downs[i % sign_passes.LANES] += value
        up_total += functools.reduce(operator.add, ups, 0.0)
        down_total += functools.reduce(operator.add, downs, 0.0)
    return up_total, down_total


@pytest.mark.parametrize("n", [compiled.BLOCK - 1, 2 * compiled.BLOCK + 65])
def test_the_sides_are_summed_in_the_documented_order(n):
    """Bit for bit against the documented order, on sizes with several blocks and a ragged last
    lane group, spread over many magnitudes so that another order would round differently."""
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=generator) * torch.exp(8 * torch.randn(n, generator=generator))
    _, up, down, _ = sign_passes.pack_and_sum_sides(x)
    want = lane_sums(x.double().tolist())
    assert (up, down) == want
    wide = x.double()
    assert (up, down) != (float(wide[wide >= 0].sum()), float(wide[wide < 0].sum()))  # the order is seen


def float64_scalars(which: int, x: torch.Tensor) -> list[float]:
    """The scalars a compiled pass sends, from float64 sums of ``x``: EF-signSGD's mean magnitude,
    1-bit SGD's side means (NaN counts as negative)."""
    wide = x.double()
    up = wide >= 0
    if which == 2:
        return [float(wide.abs().mean())]
    return [float(wide[up].sum() / max(int(up.sum()), 1)), float(wide[~up].sum() / max(int((~up).sum()), 1))]


@given(values=st.lists(st.one_of(st.sampled_from(AWKWARD), st.floats(-1e6, 1e6)), min_size=1, max_size=40),
       dtype=st.sampled_from([torch.float32, torch.float64]), which=st.integers(0, 3))
@settings(max_examples=120, deadline=None)
def test_compiled_passes_send_and_decode_as_the_tensor_arithmetic(values, dtype, which):
    """The same bits as the tensor arithmetic; scalars from float64 sums (the tensor arithmetic
    sums float32 gradients in float32, which can overflow where the mean fits), rounded to the
    gradient's dtype; and a payload decodes to the same values either way."""
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    compiled, ctx = all_compressors()[which].compress(x, "w")
    with pytest.MonkeyPatch.context() as patch:
        tensor_way(patch)
        by_tensors, _ = all_compressors()[which].compress(x, "w")
        decoded_by_tensors = all_compressors()[which].decompress(compiled, ctx)
    assert torch.equal(compiled[0], by_tensors[0])
    if which >= 2:
        sent, want = compiled[1].tolist(), float64_scalars(which, x)
        for got, exact in zip(sent, want, strict=True):
            rounded = torch.tensor(exact, dtype=torch.float64).to(dtype).item()
            close = pytest.approx(rounded, rel=4 * torch.finfo(dtype).eps)
            assert (math.isnan(got) and math.isnan(exact)) or got == close
    decoded = all_compressors()[which].decompress(compiled, ctx)
    assert torch.equal(decoded.isnan(), decoded_by_tensors.isnan())
    numbers = ~decoded.isnan()
    assert torch.equal(decoded[numbers], decoded_by_tensors[numbers])
    assert torch.equal(decoded[numbers].signbit(), decoded_by_tensors[numbers].signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum", [0.0, 0.9, 0.37])
def test_signum_compiled_step_is_the_tensor_expression_bit_for_bit(dtype, momentum, monkeypatch):
    g = torch.Generator().manual_seed(11)
    steps = [torch.randn(3, 37, generator=g, dtype=dtype) * 10.0**e for e in (0, -20, 5, 0)]
    compiled, by_tensors = Signum(momentum), Signum(momentum)
    for x in steps:
        sent = compiled.compress(x.t(), "w")[0]  # a strided gradient too
        with pytest.MonkeyPatch.context() as patch:
            tensor_way(patch)
            sent_by_tensors = by_tensors.compress(x.t(), "w")[0]
        assert torch.equal(sent[0], sent_by_tensors[0])
        assert torch.equal(compiled.momentum_buffers["w"], by_tensors.momentum_buffers["w"])
