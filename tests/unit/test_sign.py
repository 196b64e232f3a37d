import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import (
    EFSignSGD,
    EFSignSGDMemory,
    Grace,
    NoCompression,
    NoMemory,
    OneBit,
    Residual,
    SignSGD,
    Signum,
    TopK,
)
from grace_legacy.compressors.kernels import compiled, sign_passes
from grace_legacy.compressors.kernels.bits import (
    _pack_bits_torch,
    _unpack_bits_torch,
    pack_bits,
    packed_length,
    unpack_bits,
)
from grace_legacy.compressors.signs import SignContext
from grace_legacy.compressors.signsgd import majority_vote
from grace_legacy.core import wire
from grace_legacy.core.cost import bytes_sent
from tests.helpers import synchronize

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(), (1,), (7,), (8,), (3, 5), (2, 3, 4, 5)]
shapes = st.lists(st.integers(1, 6), max_size=4).map(tuple)


def all_compressors():
    return [SignSGD(), Signum(0.9), EFSignSGD(0.1), OneBit()]


def reference_pack(bits: torch.Tensor) -> np.ndarray:
    return np.packbits(bits.reshape(-1).numpy(), bitorder="little")


def tensor_of(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# -- bit packing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 71))
def test_pack_round_trips_every_length_and_matches_numpy_little_endian(n):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(n / 8),) == (packed_length(n),)
    assert np.array_equal(packed.numpy(), reference_pack(bits))
    assert torch.equal(unpack_bits(packed, n), bits)
    if n % 8:  # the unused high bits of the last byte are zero
        assert packed[-1].item() < 2 ** (n % 8)


@given(shape=shapes, seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_pack_round_trips_random_shapes(shape, seed):
    bits = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.5
    packed = pack_bits(bits)
    n = bits.numel()
    assert packed.numel() == -(-n // 8)
    assert torch.equal(unpack_bits(packed, n).view(shape), bits)


@given(shape=shapes, seed=st.integers(0, 2**16), rows=st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_the_torch_path_other_devices_take_packs_as_the_cpu_path(shape, seed, rows):
    """On CPU the bits go through numpy; on other devices through torch: same bytes, same bits,
    from non-contiguous input too (a transposed tensor, rows sliced out of a wider gather)."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.rand(shape, generator=generator) > 0.5
    for source in (bits, bits.t() if bits.dim() == 2 else bits):
        packed = pack_bits(source)
        assert torch.equal(packed, _pack_bits_torch(source))
        assert torch.equal(unpack_bits(packed, source.numel()), _unpack_bits_torch(packed, source.numel()))
    n = bits.numel()
    width = packed_length(n)
    gathered = torch.randint(0, 256, (rows, width + 5), dtype=torch.uint8, generator=generator)
    stacked = gathered[:, 3:3 + width]  # a strided view, as wire.unpack_stacked hands over
    assert torch.equal(unpack_bits(stacked, n), _unpack_bits_torch(stacked, n))


def test_empty_bits_pack_to_no_bytes_and_back():
    packed = pack_bits(torch.zeros(0, dtype=torch.bool))
    assert packed.shape == (0,) and packed.dtype == torch.uint8
    assert unpack_bits(packed, 0).shape == (0,)
    assert unpack_bits(torch.zeros(3, 0, dtype=torch.uint8), 0).shape == (3, 0)


def test_unpack_rows_unpacks_each_rank_independently():
    rows = [torch.tensor([True, False, True] * 4)[:11], torch.tensor([False] * 10 + [True])]
    packed = torch.stack([pack_bits(r) for r in rows])
    assert torch.equal(unpack_bits(packed, 11), torch.stack(rows))


def test_pack_and_unpack_refuse_wrong_input():
    with pytest.raises(TypeError, match="bool tensor"):
        pack_bits(torch.ones(3))
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.ones(2, dtype=torch.int32), 9)
    with pytest.raises(ValueError, match="9 bits need 2 bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        packed_length(-1)


# -- payload size ------------------------------------------------------------------------------------


@given(shape=shapes, dtype=st.sampled_from(DTYPES), which=st.integers(0, 3), seed=st.integers(0, 2**16))
@settings(max_examples=120, deadline=None)
def test_payload_is_packed_bits_plus_scalars_and_payload_spec_matches(shape, dtype, which, seed):
    compressor = all_compressors()[which]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    payload, ctx = compressor.compress(x, "w")
    n = x.numel()
    scalars = {SignSGD: 0, Signum: 0, EFSignSGD: 1, OneBit: 2}[type(compressor)]
    assert payload[0].dtype == torch.uint8 and payload[0].shape == (math.ceil(n / 8),)
    assert sum(p.numel() for p in payload[1:]) == scalars and all(p.dtype == dtype for p in payload[1:])
    assert compressor.payload_spec(n, dtype) == [(p.numel(), p.dtype) for p in payload]
    assert sum(p.numel() * p.element_size() for p in payload) == math.ceil(n / 8) + scalars * x.element_size()
    assert not compressor.additive and compressor.uniform_payload and not compressor.lossless
    assert bytes_sent(compressor, n, dtype) == wire.packed_size(payload, with_header=False)


@pytest.mark.parametrize("compressor,dtype,n,expected", [
    (SignSGD(), torch.float32, 1, 8), (SignSGD(), torch.float32, 64, 8), (SignSGD(), torch.float32, 65, 16),
    (SignSGD(), torch.float32, 1000, 128),
    (EFSignSGD(0.1), torch.float32, 1, 8), (EFSignSGD(0.1), torch.float32, 70, 16),
    (EFSignSGD(0.1), torch.float64, 70, 24), (EFSignSGD(0.1), torch.float16, 70, 16),
    (OneBit(), torch.float32, 1, 16), (OneBit(), torch.float32, 70, 24), (OneBit(), torch.float32, 1000, 136),
])
def test_bytes_on_the_wire(compressor, dtype, n, expected):
    # bits at offset 0, then the scalars at the next multiple of their size, the whole padded to 8
    assert bytes_sent(compressor, n, dtype) == expected


# -- signSGD and the vote ----------------------------------------------------------------------------


def test_signsgd_sends_plus_one_for_zero_and_negative_zero_and_minus_one_for_nan():
    x = tensor_of([2.0, -3.0, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), -1e-30])
    c = SignSGD()
    assert torch.equal(c.decompress(*c.compress(x, "x")), tensor_of([1, -1, 1, 1, -1, 1, -1, -1]))


def vote_through(compressor, gradients, average=True):
    compressed = [compressor.compress(g, "w") for g in gradients]
    return compressor.aggregate([p for p, _ in compressed], compressed[0][1], average)


def test_majority_vote_ties_give_zero_and_average_is_ignored():
    ranks = [tensor_of([1.0, 1.0, 1.0, -1.0, 0.0]), tensor_of([1.0, -1.0, 2.0, -1.0, 0.0]),
             tensor_of([-1.0, -1.0, 3.0, -1.0, 0.0]), tensor_of([-1.0, 1.0, -4.0, 1.0, 0.0])]
    expected = tensor_of([0.0, 0.0, 1.0, -1.0, 1.0])
    assert torch.equal(vote_through(SignSGD(), ranks, average=True), expected)
    assert torch.equal(vote_through(SignSGD(), ranks, average=False), expected)
    assert torch.equal(vote_through(SignSGD(), ranks[:3]), tensor_of([1.0, -1.0, 1.0, -1.0, 1.0]))


@given(world=st.integers(1, 6), shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_majority_vote_is_sign_of_summed_signs(world, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ranks = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
    signs = [torch.where(r >= 0, 1, -1) for r in ranks]
    expected = torch.sign(sum(signs)).to(dtype)
    out = vote_through(SignSGD(), ranks)
    assert out.dtype == dtype and out.shape == shape and torch.equal(out, expected)


# -- Signum ------------------------------------------------------------------------------------------


def test_signum_sends_the_sign_of_the_momentum_not_of_the_gradient():
    c = Signum(momentum=0.5)
    sent = []
    for g in ([4.0, -4.0], [1.0, -1.0], [-1.0, 1.0], [-8.0, 8.0]):
        payload, ctx = c.compress(tensor_of(g), "w")
        sent.append(c.decompress(payload, ctx).tolist())
    # m: [2, -2], [1.5, -1.5], [0.25, -0.25], [-3.875, 3.875] (all exact in binary)
    assert torch.equal(c.momentum_buffers["w"], tensor_of([-3.875, 3.875]))
    assert sent == [[1, -1], [1, -1], [1, -1], [-1, 1]]


@given(momentum=st.sampled_from([0.0, 0.25, 0.5, 0.75]),
       steps=st.lists(st.lists(st.integers(-64, 64), min_size=5, max_size=5), min_size=1, max_size=5))
@settings(max_examples=60, deadline=None)
def test_signum_momentum_follows_its_recurrence(momentum, steps):
    # Integer gradients and dyadic momenta keep every value exact in fp32 and fp64 for 5 steps.
    c = Signum(momentum)
    m = torch.zeros(5, dtype=torch.float64)
    for g in steps:
        payload, ctx = c.compress(tensor_of(g), "w")
        m = momentum * m + (1 - momentum) * tensor_of(g, torch.float64)
        assert torch.equal(c.momentum_buffers["w"].double(), m)
        assert torch.equal(c.decompress(payload, ctx), torch.where(m >= 0, 1.0, -1.0).float())


def test_signum_with_zero_momentum_is_signsgd():
    g = torch.Generator().manual_seed(3)
    c, plain = Signum(0.0), SignSGD()
    for _ in range(3):
        x = torch.randn(50, generator=g)
        assert torch.equal(c.compress(x, "w")[0][0], plain.compress(x, "w")[0][0])


def test_signum_state_dict_round_trip_is_a_copy():
    g = torch.Generator().manual_seed(0)
    a = Signum(0.9)
    for _ in range(2):
        a.compress(torch.randn(4, 3, generator=g), "w")
        a.compress(torch.randn(()), "s")
    state = a.state_dict()
    saved = state["momentum_buffers"]["w"].clone()
    b = Signum(0.9)
    b.load_state_dict(state)
    x = torch.randn(4, 3, generator=g)
    assert torch.equal(a.compress(x, "w")[0][0], b.compress(x, "w")[0][0])
    assert torch.equal(a.momentum_buffers["w"], b.momentum_buffers["w"])
    assert torch.equal(state["momentum_buffers"]["w"], saved)  # compressing did not touch the saved state
    assert b.momentum_buffers["s"].shape == ()


def test_signum_keeps_half_precision_momentum_in_fp32():
    c = Signum(0.9)
    for dtype in (torch.float16, torch.bfloat16):
        c.compress(torch.randn(6).to(dtype), str(dtype))
        assert c.momentum_buffers[str(dtype)].dtype == torch.float32
    c.compress(torch.randn(6, dtype=torch.float64), "d")
    assert c.momentum_buffers["d"].dtype == torch.float64


def test_signum_refuses_a_tensor_that_changed_shape():
    c = Signum()
    c.compress(torch.randn(3), "w")
    with pytest.raises(ValueError, match="changed from"):
        c.compress(torch.randn(4), "w")


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, float("nan"), float("inf")])
def test_signum_momentum_must_be_in_zero_one(bad):
    with pytest.raises(ValueError, match=r"Signum: momentum must be a number in \[0, 1\)"):
        Signum(bad)


@pytest.mark.parametrize("bad", [None, "0.9", True, torch.tensor(0.9)])
def test_signum_momentum_of_wrong_type(bad):
    with pytest.raises(TypeError, match="Signum: momentum"):
        Signum(bad)


# -- EF-signSGD --------------------------------------------------------------------------------------


def test_efsignsgd_sends_mean_magnitude_times_sign():
    x = tensor_of([[1.0, -2.0], [0.0, -5.0]])
    c = EFSignSGD(0.1)
    payload, ctx = c.compress(x, "w")
    assert torch.equal(payload[1], tensor_of([2.0]))
    assert torch.equal(c.decompress(payload, ctx), tensor_of([[2.0, -2.0], [2.0, -2.0]]))


def half_spacing_fp32(value: float) -> Fraction:
    """Half the distance from |value| to the next fp32 above it: a bound on the rounding error of
    any fp32 operation whose result is ``value`` (round to nearest)."""
    a = torch.tensor(abs(value), dtype=torch.float32)
    return Fraction((torch.nextafter(a, torch.tensor(math.inf)) - a).item()) / 2


@given(lr=st.sampled_from([1.0, 0.1, 0.05, 3e-4]),
       steps=st.lists(st.integers(0, 2**16), min_size=1, max_size=5), n=st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_efsignsgd_memory_keeps_sent_plus_new_error_equal_to_compensated(lr, steps, n):
    compressor, memory = EFSignSGD(lr), EFSignSGDMemory(lr)
    for seed in steps:
        g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        old = memory.residuals.get("w", torch.zeros(n)).clone()
        compensated = memory.compensate(g, "w")
        assert torch.equal(compensated, g * lr + old)
        payload, ctx = compressor.compress(compensated, "w")
        memory.update(compensated, "w", compressor, payload, ctx)
        sent, error = compressor.decompress(payload, ctx), memory.residuals["w"]
        # Exactly, up to the one rounding of error = compensated - sent:
        for s, e, p in zip(sent.tolist(), error.tolist(), compensated.tolist(), strict=True):
            assert abs(Fraction(s) + Fraction(e) - Fraction(p)) <= half_spacing_fp32(e)


def test_efsignsgd_memory_divides_the_aggregate_by_lr_and_forgets_dense_sends():
    memory = EFSignSGDMemory(0.25)
    assert torch.equal(memory.aggregated("w", tensor_of([1.0, -0.5])), tensor_of([4.0, -2.0]))
    memory.residuals["w"] = tensor_of([1.0, 1.0])
    compensated = memory.compensate(tensor_of([4.0, 8.0]), "w")
    assert torch.equal(compensated, tensor_of([2.0, 3.0]))
    memory.update(compensated, "w", NoCompression(), [compensated], None)
    assert "w" not in memory.residuals


def test_efsignsgd_requires_its_memory_with_the_same_lr():
    assert repr(Grace(EFSignSGD(0.1)).memory) == "EFSignSGDMemory(lr=0.1)"
    Grace(EFSignSGD(0.1), memory=EFSignSGDMemory(0.1))
    for other in (Residual(), NoMemory()):
        with pytest.raises(ValueError, match=r"EFSignSGD\(lr=0.1\) needs EFSignSGDMemory\(lr=0.1\), got"):
            Grace(EFSignSGD(0.1), memory=other)
    with pytest.raises(ValueError, match="same learning rate, got EFSignSGDMemory\\(lr=0.2\\)"):
        Grace(EFSignSGD(0.1), memory=EFSignSGDMemory(0.2))


@pytest.mark.parametrize("make", [EFSignSGD, EFSignSGDMemory])
@pytest.mark.parametrize("bad,error", [(0, ValueError), (-0.1, ValueError), (float("inf"), ValueError),
                                       (None, TypeError), ("0.1", TypeError)])
def test_lr_must_be_positive(make, bad, error):
    with pytest.raises(error, match=f"{make.__name__}: lr must be a number in \\(0, inf\\)"):
        make(bad)


# -- 1-bit SGD ---------------------------------------------------------------------------------------


def test_onebit_decodes_each_entry_to_its_sides_mean():
    x = tensor_of([3.0, -1.0, 0.0, 6.0, -3.0])
    c = OneBit()
    payload, ctx = c.compress(x, "w")
    assert torch.equal(payload[1], tensor_of([3.0, -2.0]))
    assert torch.equal(c.decompress(payload, ctx), tensor_of([3.0, -2.0, 3.0, 3.0, -2.0]))


@pytest.mark.parametrize("values,means", [([1.0, 2.0, 0.0], [1.0, 0.0]), ([-1.0, -2.0], [0.0, -1.5]),
                                          ([0.0], [0.0, 0.0]), ([-4.0], [0.0, -4.0])])
def test_onebit_empty_side_has_mean_zero(values, means):
    c = OneBit()
    payload, ctx = c.compress(tensor_of(values), "w")
    assert torch.equal(payload[1], tensor_of(means))


@given(n=st.integers(1, 64), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_onebit_means_are_the_side_means(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    c = OneBit()
    payload, ctx = c.compress(x, "w")
    decoded = c.decompress(payload, ctx)
    nonnegative = x >= 0
    assert torch.equal(decoded[nonnegative], payload[1][0].expand(int(nonnegative.sum())))
    assert torch.equal(decoded[~nonnegative], payload[1][1].expand(int((~nonnegative).sum())))
    # One side's entries share a sign, so an fp32 sum of k of them is within k units of roundoff.
    for side, mean in ((nonnegative, payload[1][0]), (~nonnegative, payload[1][1])):
        if side.any():
            exact = x[side].double().mean()
            assert abs(mean.item() - exact.item()) <= (int(side.sum()) + 1) * 2**-24 * abs(exact.item())


def test_onebit_aggregate_is_the_mean_of_decoded_payloads():
    c = OneBit()
    ranks = [tensor_of([3.0, -1.0, 1.0]), tensor_of([-2.0, 4.0, -4.0])]  # decode to [2, -1, 2] and [-3, 4, -3]
    assert torch.equal(vote_through(c, ranks, average=True), tensor_of([-0.5, 1.5, -0.5]))
    assert torch.equal(vote_through(c, ranks, average=False), tensor_of([-1.0, 3.0, -1.0]))
    assert isinstance(Grace(c).memory, Residual) and isinstance(Grace(SignSGD()).memory, NoMemory)


# -- non-finite values, shapes, dtypes, bad tensors --------------------------------------------------


def test_scalars_carry_non_finite_values_on():
    ef, onebit = EFSignSGD(1.0), OneBit()
    assert torch.isinf(ef.compress(tensor_of([1.0, float("inf")]), "w")[0][1]).all()
    assert torch.isnan(ef.compress(tensor_of([1.0, float("nan")]), "w")[0][1]).all()
    means = onebit.compress(tensor_of([1.0, float("nan"), -1.0]), "w")[0][1]
    assert means[0].item() == 1.0 and math.isnan(means[1].item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_scalars_are_accumulated_without_overflow(dtype):
    big = torch.full((4,), 60000.0, dtype=dtype)
    assert torch.isfinite(EFSignSGD(1.0).compress(big, "w")[0][1]).all()
    assert torch.isfinite(OneBit().compress(torch.cat([big, -big]), "w")[0][1]).all()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", range(4))
def test_any_shape_and_dtype_decodes_to_the_input_shape_and_dtype(which, shape, dtype):
    compressor = all_compressors()[which]
    x = torch.randn(shape).to(dtype)
    payload, ctx = compressor.compress(x, "w")
    out = compressor.decompress(payload, ctx)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out >= 0, x >= 0)  # every compressor keeps the bit x >= 0
    agg = compressor.aggregate([payload, payload], ctx, True)
    assert agg.shape == x.shape and agg.dtype == dtype


@pytest.mark.parametrize("which", range(4))
def test_bad_tensors_are_refused_clearly(which):
    compressor = all_compressors()[which]
    with pytest.raises(ValueError, match="empty tensor"):
        compressor.compress(torch.zeros(0, 3), "x")
    with pytest.raises(TypeError, match="floating point"):
        compressor.compress(torch.arange(10), "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        compressor.compress([1.0, 2.0], "x")
    with pytest.raises(TypeError, match="sparse"):
        compressor.compress(torch.eye(3).to_sparse(), "x")
    with pytest.raises(TypeError, match="must be float32, float64, float16 or bfloat16, got torch.float8"):
        compressor.compress(torch.ones(3).to(torch.float8_e4m3fn), "x")


def test_reprs():
    assert [repr(c) for c in all_compressors()] == ["SignSGD()", "Signum(momentum=0.9)", "EFSignSGD(lr=0.1)",
                                                    "OneBit()"]


# -- through Grace, with in-process ranks ------------------------------------------------------------
# These tensors are tiny, so Grace's dense fallback would send them dense; it is turned off to
# exercise the compressors themselves (the fallback has its own tests).


def dyadic(seed: int, n: int, world: int) -> list[torch.Tensor]:
    """Multiples of 1/8 below 4 in magnitude: with n and lr powers of two, EF-signSGD is exact."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-32, 33, (n,), generator=g).float() / 8 for _ in range(world)]


def test_grace_efsignsgd_applies_the_mean_of_the_ranks_steps_divided_by_lr():
    world, n, lr = 4, 8, 0.25
    steps = [dyadic(seed, n, world) for seed in range(4)]
    results = synchronize([Grace(EFSignSGD(lr), dense_fallback=False) for _ in range(world)], steps)
    # Karimireddy et al. (2019), Algorithm 1, per rank, then the mean of the ranks' steps over lr.
    errors = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    for gradients, synced in zip(steps, results, strict=True):
        deltas = []
        for r, g in enumerate(gradients):
            p = lr * g.double() + errors[r]
            delta = p.abs().sum() / n * torch.where(p >= 0, 1.0, -1.0).double()
            errors[r] = p - delta
            deltas.append(delta)
        expected = (sum(deltas) / world / lr).float()
        for rank_result in synced:
            assert torch.equal(rank_result, expected)


def test_grace_signsgd_and_signum_vote_with_ties_on_four_ranks():
    steps = [[tensor_of([1.0, -1.0, 2.0]), tensor_of([1.0, 1.0, -2.0]), tensor_of([-1.0, -1.0, 0.0]),
              tensor_of([-1.0, -1.0, 1.0])]]
    for make in (SignSGD, lambda: Signum(0.5)):
        for average in (True, False):
            results = synchronize([Grace(make(), dense_fallback=False) for _ in range(4)], steps, average)
            assert all(torch.equal(r, tensor_of([0.0, -1.0, 1.0])) for r in results[0])


def test_grace_onebit_with_residual_sends_the_error_next_step():
    bundles = [Grace(OneBit(), dense_fallback=False), Grace(OneBit(), dense_fallback=False)]
    # Rank 0 decodes to [2, -2, 2, -2] and keeps [1, 1, -1, -1]; rank 1 decodes to [1, 1, -3, -3] and
    # keeps [1, -1, 1, -1]. Next step, with zero gradients, those residuals are sent and decode exactly.
    first = synchronize(bundles, [[tensor_of([3.0, -1.0, 1.0, -3.0]), tensor_of([2.0, 0.0, -2.0, -4.0])]])
    assert all(torch.equal(r, tensor_of([1.5, -0.5, -0.5, -2.5])) for r in first[0])
    assert torch.equal(bundles[0].memory.residuals["w"], tensor_of([1.0, 1.0, -1.0, -1.0]))
    assert torch.equal(bundles[1].memory.residuals["w"], tensor_of([1.0, -1.0, 1.0, -1.0]))
    second = synchronize(bundles, [[torch.zeros(4), torch.zeros(4)]])
    assert all(torch.equal(r, tensor_of([1.0, 0.0, 0.0, -1.0])) for r in second[0])


def test_grace_counts_the_packed_bytes():
    world, n = 2, 70
    bundles = [Grace(SignSGD(), dense_fallback=False) for _ in range(world)]
    synchronize(bundles, [dyadic(0, n, world)])
    assert bundles[0].stats["bytes_sent"] == 16 and bundles[0].stats["bytes_dense"] == 4 * n


def test_efsignsgd_memory_scales_any_compressor_back_to_gradient_units():
    bundle = Grace(TopK(0.5), memory=EFSignSGDMemory(0.5), dense_fallback=False)
    result = synchronize([bundle], [[tensor_of([4.0, -1.0, 2.0, 0.5])]])[0][0]
    assert torch.equal(result, tensor_of([4.0, 0.0, 2.0, 0.0]))
    assert torch.equal(bundle.memory.residuals["w"], tensor_of([0.0, -0.5, 0.0, 0.25]))


def test_a_vote_of_more_ranks_than_int16_can_double_still_counts_right():
    ctx = SignContext(torch.Size([3]), 3, torch.float32, torch.device("cpu"))
    yes, no = pack_bits(torch.tensor([True, False, True])), pack_bits(torch.tensor([False, False, True]))
    # 8,193 + 8,192 = 16,385 ranks: 2 * ranks overflows int16.
    vote = majority_vote([[yes]] * 8193 + [[no]] * 8192, ctx)
    assert torch.equal(vote, torch.tensor([1.0, -1.0, 1.0]))
    tie = majority_vote([[yes]] * 8192 + [[no]] * 8192, ctx)
    assert torch.equal(tie, torch.tensor([0.0, -1.0, 1.0]))


# -- the compiled CPU passes against the tensor arithmetic other devices use --------------------------

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
    # Finite sums come from value +- |value| without selects: the same numbers the selects give.
    exact = sign_passes.sides(x.numpy(), packed.numpy().copy(), True)
    assert (up, down, count) == exact
    assert up == pytest.approx(float(x[x >= 0].double().sum()), rel=1e-12, abs=1e-300)
    assert down == pytest.approx(float(x[x < 0].double().sum()), rel=1e-12, abs=1e-300)


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
