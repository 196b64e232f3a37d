"""The hot path's shortcuts give what the straightforward code gives.

- ``nonfinite_flag`` (one ``aminmax``) answers as ``~torch.isfinite(x).all()`` does.
- ``Residual`` keeps ``g + e`` with the sent entries zeroed for compressors that send entries:
  bit for bit the reference ``(g + e) - D(C(g + e))`` on finite input, and it never writes into
  a tensor it did not make.
- ``Grace`` looks only at the compensated gradient when the memory keeps infs and NaNs.
- ``Legacy`` computes its phase once per progress, and still follows every change of progress.
- Threshold's one-pass selection finds the positions ``torch.nonzero(|x| >= t)`` finds.
- Random-k's subsets without a full permutation are still uniform.
- A bucket packed in one buffer is the concatenation of its members' packed payloads; a
  header-less bucket's stacked views are every rank's parts; one scatter-add for a bucket of
  sparse members gives each member's own scatter-sum, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy import DGC, Allgather, Grace, Legacy, NoMemory, RandomK, Residual, Threshold, TopK
from grace_legacy.communicators.exchange import BucketExchange, Parcel
from grace_legacy.compressors.kernels.selection import SMALL, entries_at_or_above, magnitude_bound
from grace_legacy.compressors.randomk import uniform_subset
from grace_legacy.compressors.sparse import SparseContext, scatter_sum, scatter_sum_many
from grace_legacy.runtime import wire
from grace_legacy.runtime.validation import nonfinite_flag
from tests.helpers import bits, run_ranks

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


def sparsifier(kind: str, ratio: float):
    return {"topk": lambda: TopK(ratio), "randomk": lambda: RandomK(ratio, seed=3),
            "threshold": lambda: Threshold(ratio * 2), "dgc": lambda: DGC(ratio)}[kind]()


@given(kind=st.sampled_from(["topk", "randomk", "threshold", "dgc"]), ratio=st.sampled_from([0.001, 0.01, 0.3, 1.0]),
       n=st.integers(1, 70_000), dtype=st.sampled_from(DTYPES), steps=st.integers(1, 4), seed=st.integers(0, 2**16))
@settings(max_examples=80, deadline=None)
def test_residual_in_place_equals_the_subtraction_bit_for_bit(kind, ratio, n, dtype, steps, seed):
    compressor = sparsifier(kind, ratio)
    assert compressor.sends_entries
    memory, reference = Residual(), None
    draw = torch.Generator().manual_seed(seed)
    for step in range(steps):
        g = torch.randn(n, generator=draw).to(dtype)
        expected_compensated = g if reference is None else g + reference
        compensated = memory.compensate(g, "w")
        assert torch.equal(compensated, expected_compensated)
        payload, ctx = compressor.compress(compensated, "w")
        sent = compressor.decompress(payload, ctx)
        reference = expected_compensated - sent
        before = g.clone()
        memory.update(compensated, "w", compressor, payload, ctx)
        memory.end_step()
        assert torch.equal(g, before), "the gradient itself must never be written into"
        if step > 0:  # compensate made g + e: the in-place path was taken
            assert memory.residuals["w"] is compensated
        assert bits(memory.residuals["w"]).equal(bits(reference)), "bit for bit, signed zeros included"


def test_residual_does_not_write_into_a_tensor_it_did_not_make():
    memory = Residual()
    memory.residuals["w"] = torch.ones(100)
    mine = torch.arange(100.0)
    compressor = TopK(0.1)
    payload, ctx = compressor.compress(mine, "w")
    memory.update(mine, "w", compressor, payload, ctx)
    assert torch.equal(mine, torch.arange(100.0))
    assert memory.residuals["w"] is not mine
    assert torch.equal(memory.residuals["w"][:90], torch.arange(90.0))


def test_rollback_after_the_in_place_update_restores_the_old_residual():
    memory, compressor = Residual(), TopK(0.1)
    memory.residuals["w"] = old = torch.linspace(-1, 1, 50)
    kept = old.clone()
    compensated = memory.compensate(torch.randn(50), "w")
    memory.update(compensated, "w", compressor, *compressor.compress(compensated, "w"))
    assert memory.residuals["w"] is compensated
    memory.undo("w")
    assert memory.residuals["w"] is old and torch.equal(old, kept)


@pytest.mark.parametrize("memory_class", [Residual, NoMemory])
def test_grace_flags_a_raw_nan_that_compression_drops(memory_class):
    """Residual and NoMemory keep NaNs, so Grace looks only at what they return; a NaN that
    Threshold never sends is still flagged, on every rank."""
    assert memory_class.keeps_nonfinite

    def body(backend):
        memory = memory_class()
        if memory_class is Residual:
            memory.residuals["w"] = torch.zeros(1000)  # so that compensate makes g + e
        bundle = Grace(Threshold(0.5), memory)
        g = torch.linspace(-1, 1, 1000)
        if backend.rank() == 0:
            g[7] = float("nan")
        result = bundle.start(g, "w", backend, average=True)()
        assert bool(torch.isfinite(result).all())  # only the flag can tell
        return bundle.nonfinite_names(["w"], backend)

    assert run_ranks(2, body) == [{"w"}, {"w"}]


@given(steps_per_epoch=st.integers(1, 7), epochs=st.integers(2, 6), phases=st.integers(2, 4),
       moves=st.lists(st.one_of(st.just("step"), st.integers(0, 8)), max_size=40))
@settings(max_examples=100, deadline=None)
def test_legacy_phase_cache_follows_every_change_of_progress(steps_per_epoch, epochs, phases, moves):
    values = [[0.5 / (p + 1), 0.1 / (p + 1)] for p in range(phases)]
    schedule = Legacy(TopK(), by="both", values=values, splits=[100], epochs=epochs, steps_per_epoch=steps_per_epoch)
    small, large = torch.zeros(10), torch.zeros(1000)
    for move in moves:
        if move == "step":
            schedule.end_step()
        else:
            schedule.set_epoch(move)
        phase = schedule.phase_of(schedule.progress)
        assert schedule.value_for(small, "s") == values[phase][0]
        assert schedule.value_for(large, "l") == values[phase][1]
        assert schedule.traffic_labels("l", large) == {"group": 1, "phase": phase}
    state = schedule.state_dict()
    fresh = Legacy(TopK(), by="both", values=values, splits=[100], epochs=epochs, steps_per_epoch=steps_per_epoch)
    fresh.value_for(small, "s")  # fill the cache at progress 0 before loading
    fresh.load_state_dict(state)
    assert fresh.current_phase() == schedule.phase_of(schedule.progress)


@given(n=st.one_of(st.integers(1, 1000), st.integers(SMALL, SMALL + 100_000)), dtype=st.sampled_from(DTYPES),
       threshold=st.floats(0.0, 5.0),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS + [0.0, -0.0])), max_size=6),
       seed=st.integers(0, 2**16), index_dtype=st.sampled_from([torch.int32, torch.int64]))
@settings(max_examples=150, deadline=None)
def test_threshold_entries_equal_torch_nonzero_and_a_gather(n, dtype, threshold, specials, seed, index_dtype):
    """Both routes (torch below SMALL entries, the compiled range pass above) keep exactly the
    entries ``torch.nonzero(|x| >= bound)`` finds, at every fraction kept, with their values bit for
    bit (signed zeros) and positions in the wire's index dtype."""
    flat = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    for position, value in specials:
        flat[position % n] = value
    bound = magnitude_bound(threshold, dtype)[0]
    expected = torch.nonzero(flat.abs() >= bound).reshape(-1)
    values, indices = entries_at_or_above(flat, threshold, index_dtype)
    assert indices.dtype == index_dtype and values.dtype == dtype
    assert torch.equal(indices.long(), expected)
    assert torch.equal(bits(values), bits(flat[expected]))


@pytest.mark.parametrize("numel", [5, SMALL])
def test_threshold_entries_with_an_infinite_bound_are_the_infinities(numel):
    flat = torch.zeros(numel)
    flat[:5] = torch.tensor([1.0, float("inf"), float("nan"), -float("inf"), 3e38])
    values, indices = entries_at_or_above(flat, float("inf"), torch.int32)
    assert indices.tolist() == [1, 3] and values.tolist() == [float("inf"), -float("inf")]


def test_threshold_entries_when_none_or_all_pass():
    flat = torch.randn(SMALL, generator=torch.Generator().manual_seed(3))
    values, indices = entries_at_or_above(flat, 100.0, torch.int32)
    assert values.numel() == 0 and indices.numel() == 0 and indices.dtype == torch.int32
    values, indices = entries_at_or_above(flat, 0.0, torch.int32)
    assert torch.equal(indices, torch.arange(SMALL, dtype=torch.int32)) and torch.equal(values, flat)


@given(n=st.integers(1, 10**7), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
@settings(max_examples=100, deadline=None)
def test_uniform_subset_is_k_distinct_values_in_range(n, fraction, seed):
    k = max(1, min(n, int(fraction * min(n, 50_000))))
    subset = uniform_subset(n, k, torch.Generator().manual_seed(seed))
    assert subset.dtype == torch.int64 and subset.numel() == k
    assert subset.unique().numel() == k and int(subset.min()) >= 0 and int(subset.max()) < n


@pytest.mark.parametrize(("n", "k"), [(9, 2), (12, 3)])
def test_uniform_subset_makes_every_subset_equally_likely(n, k):
    """Chi-square over every k-subset (the rejection path: 4k <= n), fixed seeds, so not flaky."""
    from itertools import combinations

    from scipy.stats import chisquare

    cells = {frozenset(c): 0 for c in combinations(range(n), k)}
    draws = 60 * len(cells)
    for seed in range(draws):
        cells[frozenset(uniform_subset(n, k, torch.Generator().manual_seed(seed)).tolist())] += 1
    assert chisquare(list(cells.values())).pvalue > 1e-4


@given(members=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 9), st.sampled_from(
    [torch.float32, torch.int32, torch.float16, torch.uint8, torch.int64])), min_size=1, max_size=3), st.booleans()),
    min_size=1, max_size=6), world=st.integers(1, 4))
@settings(max_examples=100, deadline=None)
def test_pack_many_is_the_concatenation_of_packs_and_unpacks_back(members, world):
    def payload(parts, rank):
        return [torch.arange(rank * 100, rank * 100 + rows * 2).to(dtype).view(rows, 2) for rows, dtype in parts]

    local = [(payload(parts, 0), with_header) for parts, with_header in members]
    assert torch.equal(wire.pack_many(local), torch.cat([wire.pack(p, h) for p, h in local]))
    # Every rank sends the same shapes (a header-less member must); the contents differ.
    gathered = torch.cat([wire.pack_many([(payload(parts, r), h) for parts, h in members]) for r in range(world)])
    back = wire.unpack_gathered_many(gathered, local, world, "bucket")
    for index, (parts, _) in enumerate(members):
        for rank in range(world):
            for got, want in zip(back[index][rank], payload(parts, rank), strict=True):
                assert torch.equal(got, want)


def test_uniform_subset_tops_up_when_the_first_draws_repeat(monkeypatch):
    """A first stream of nothing but repeats must be topped up, not loop forever."""
    real_randint = torch.randint
    calls = []

    def randint(high, size, generator=None):
        calls.append(size)
        if len(calls) == 1:
            return torch.zeros(size, dtype=torch.int64)
        return real_randint(high, size, generator=generator)

    monkeypatch.setattr(torch, "randint", randint)
    subset = uniform_subset(1000, 50, torch.Generator().manual_seed(0))
    assert len(calls) >= 2 and subset.unique().numel() == 50 and 0 in subset.tolist()


def test_an_integer_knob_refuses_a_fraction_whose_float_is_an_integer():
    """Found by the fuzzer: float(Fraction(2**53 + 1, 2)) rounds to the integer 2**52."""
    from fractions import Fraction

    from grace_legacy import PowerSGD

    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=Fraction(2**53 + 1, 2))
    assert PowerSGD(rank=Fraction(8, 2)).value == 4


@given(members=st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 9), st.sampled_from(
    [torch.float32, torch.int32, torch.float16, torch.uint8, torch.int64])), min_size=1, max_size=3),
    st.booleans()), min_size=1, max_size=6), world=st.integers(1, 4))
@settings(max_examples=100, deadline=None)
def test_stacked_views_of_a_headerless_bucket_are_every_ranks_parts(members, world):
    def part(numel, dtype, rank, scalar):
        values = torch.arange(numel, dtype=torch.int64) * (rank + 3) + rank
        shaped = values.reshape(()) if scalar and numel == 1 else values.reshape(numel, 1)
        return shaped.to(dtype)

    def payload(member, rank):
        parts, scalar = member
        return [part(numel, dtype, rank, scalar) for numel, dtype in parts]

    local = [(payload(m, 0), False) for m in members]
    gathered = torch.cat([wire.pack_many([(payload(m, r), False) for m in members]) for r in range(world)])
    stacked = wire.unpack_stacked(gathered, local, world, "bucket")
    for member, parts in zip(members, stacked, strict=True):
        for rank in range(world):
            for got, want in zip(parts, payload(member, rank), strict=True):
                assert got[rank].dtype == want.dtype and torch.equal(got[rank], want)
        back = wire.per_rank(parts)
        assert len(back) == world
        for rank in range(world):
            assert all(torch.equal(g, w) for g, w in zip(back[rank], payload(member, rank), strict=True))


def test_stacked_views_refuse_headers_and_report_ranks_that_disagree():
    payload = [torch.ones(4), torch.arange(4, dtype=torch.int32)]
    with pytest.raises(ValueError, match="size header"):
        wire.unpack_stacked(wire.pack(payload, True), [(payload, True)], 1, "w")
    other = [torch.ones(5), torch.arange(5, dtype=torch.int32)]
    gathered = torch.cat([wire.pack(payload, False), wire.pack(other, False)])
    with pytest.raises(RuntimeError, match="ranks disagree on the payload size of 'w'"):
        wire.unpack_stacked(gathered, [(payload, False)], 2, "w")


ENTRY_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@given(data=st.data(), world=st.integers(1, 4), average=st.booleans())
@settings(max_examples=150, deadline=None)
def test_one_scatter_add_for_a_bucket_is_each_members_scatter_sum_bit_for_bit(data, world, average):
    """Repeated indices, signed zeros, infinities and NaN included, members of several dtypes."""
    members = []
    for _ in range(data.draw(st.integers(1, 5))):
        numel = data.draw(st.integers(1, 40))
        k = data.draw(st.integers(0, 12))
        dtype = data.draw(st.sampled_from(ENTRY_DTYPES))
        index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
        pool = [0.0, -0.0, 1.5, -2.25, 1e-3, 3e4, *SPECIALS]
        values = torch.tensor(data.draw(st.lists(st.lists(st.one_of(st.sampled_from(pool), st.floats(-1e3, 1e3)),
                                                          min_size=k, max_size=k), min_size=world, max_size=world)),
                              dtype=torch.float64).reshape(world, k).to(dtype)
        indices = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, numel - 1), min_size=k, max_size=k),
                                                  min_size=world, max_size=world)), dtype=torch.int64)
        shape = data.draw(st.sampled_from([(numel,), (1, numel)]))
        ctx = SparseContext(torch.Size(shape), numel, dtype, torch.device("cpu"))
        members.append((values, indices.reshape(world, k).to(index_dtype), ctx))
    joint = scatter_sum_many(members, average)
    for (values, indices, ctx), got in zip(members, joint, strict=True):
        want = scatter_sum([[values[r], indices[r]] for r in range(world)], ctx, average)
        assert got.shape == want.shape and got.dtype == want.dtype
        # Bit patterns (so -0.0 != 0.0), except a NaN's sign and payload, which torch's kernels
        # do not keep alike (seen for bfloat16 between int32 and int64 indices).
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(bits(got[~nan]), bits(want[~nan]))


@pytest.mark.parametrize("make", [lambda: TopK(0.2), lambda: DGC(0.2, min_samples=4),
                                  lambda: Legacy(TopK(), by="layer", values=[0.5, 0.1], splits=[50])])
def test_a_bucket_of_scattered_members_aggregates_as_each_member_alone(make):
    """The bucket's joint scatter-add against each member's own ``aggregate`` (4 threaded ranks)."""
    shapes = {"a": (30,), "b": (8, 9), "c": (200,), "d": ()}

    def run(backend, bucket_bytes):
        bundle = Grace(make(), memory=NoMemory(), dense_fallback=False, communicator=Allgather())
        bundle.bucket_bytes = bucket_bytes
        bundle.plan_buckets([(n, 4 * torch.Size(s).numel()) for n, s in shapes.items()])
        grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(7 * backend.rank() + i))
                 for i, (n, s) in enumerate(shapes.items())}
        pending = {n: bundle.start(g, n, backend, True) for n, g in grads.items()}
        return {n: p() for n, p in pending.items()}

    alone, fused = run_ranks(4, lambda b: run(b, 0)), run_ranks(4, lambda b: run(b, 1 << 20))
    for rank in range(4):
        for name in shapes:
            assert torch.equal(fused[rank][name], alone[rank][name]), (rank, name)


@pytest.mark.parametrize("dtype, by_part", [(torch.float32, True), (torch.float64, False), (torch.float16, False),
                                            (torch.bfloat16, False)])
def test_a_bucket_goes_by_part_only_when_that_sends_the_same_bytes_and_aggregates_exactly_either_way(
        dtype, by_part, monkeypatch):
    """Top-k at 0.05 keeps 1, 3 and 10 entries: fp32 values and int32 indices pack by part into
    exactly the members' bytes; wider or narrower values would change the padding, so those
    buckets keep each payload's own packing. Each result is checked against the compressor's own
    ``aggregate`` of every rank's payload."""
    shapes = {"a": (31,), "b": (7, 9), "c": (201,)}
    compressor = TopK(0.05)
    world = 3

    def payloads(rank):
        grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(10 * rank + i)).to(dtype)
                 for i, (n, s) in enumerate(shapes.items())}
        return {n: compressor.compress(g, n) for n, g in grads.items()}

    packings = []

    def spy(packing):
        original = getattr(wire, packing)

        def packed(*args):
            packings.append(packing)
            return original(*args)
        return packed

    for packing in ("pack_columns", "pack_many"):
        monkeypatch.setattr(wire, packing, spy(packing))

    def body(backend):
        members = [Parcel(n, payload, ctx, compressor, gathered=True)
                   for n, (payload, ctx) in payloads(backend.rank()).items()]
        BucketExchange("bucket", members, backend, average=True)
        return {m.name: m.pending() for m in members}, sum(m.pending.bytes_sent for m in members), list(backend.calls)

    ranks = run_ranks(world, body)
    assert set(packings) == {"pack_columns" if by_part else "pack_many"}
    sent = [payloads(rank) for rank in range(world)]
    for results, bytes_sent, calls in ranks:
        assert calls == [("allgather", bytes_sent)]
        for name in shapes:
            want = compressor.aggregate([sent[rank][name][0] for rank in range(world)], sent[0][name][1], True)
            assert torch.equal(results[name], want), name
