"""The wire layout of gathered payloads (``runtime/wire.py``): packed buffers round-trip with and
without size headers, scalar parts keep their zero dims, Top-k's fp32 payload needs no padding,
ranks that disagree on sizes and truncated buffers are reported; a bucket packed in one buffer is
the concatenation of its members' packings, a header-less bucket's stacked views are every rank's
parts, and the by-part layout round-trips every column over all ranks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grace_legacy.runtime import wire

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8,
          torch.int8]


def make_part(dtype, rows, trailing, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (rows, *trailing)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


part_specs = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 3), max_size=2)),
                      min_size=1, max_size=4)


@given(specs=part_specs, rows=st.lists(st.lists(st.integers(0, 9), min_size=4, max_size=4), min_size=1,
                                        max_size=4))
@settings(max_examples=80, deadline=None)
def test_header_layout_round_trips_ranks_with_different_sizes(specs, rows):
    specs = specs[: len(rows[0])]
    payloads = [[make_part(dtype, rank_rows[i], trailing, 31 * r + i) for i, (dtype, trailing) in enumerate(specs)]
                for r, rank_rows in enumerate(rows)]
    buffers = [wire.pack(p, with_header=True) for p in payloads]
    assert all(b.numel() % 8 == 0 for b in buffers)
    back = wire.unpack_gathered(torch.cat(buffers), payloads[0], len(payloads), True, "t")
    for sent, received in zip(payloads, back, strict=True):
        for a, b in zip(sent, received, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@given(specs=part_specs, world=st.integers(1, 5), rows=st.integers(0, 7))
@settings(max_examples=60, deadline=None)
def test_headerless_layout_round_trips_uniform_payloads(specs, world, rows):
    payloads = [[make_part(dtype, rows, trailing, 7 * r + i) for i, (dtype, trailing) in enumerate(specs)]
                for r in range(world)]
    buffers = [wire.pack(p, with_header=False) for p in payloads]
    assert buffers[0].numel() == wire.packed_size(payloads[0], with_header=False)
    back = wire.unpack_gathered(torch.cat(buffers), payloads[0], world, False, "t")
    for sent, received in zip(payloads, back, strict=True):
        for a, b in zip(sent, received, strict=True):
            assert torch.equal(a, b) and a.shape == b.shape


def test_scalar_parts_keep_zero_dims():
    payload = [torch.tensor(2.5), torch.tensor([1, 2, 3], dtype=torch.int32)]
    back = wire.unpack_gathered(wire.pack(payload, True), payload, 1, True, "t")
    assert back[0][0].shape == () and back[0][0].item() == 2.5


def test_topk_fp32_payload_needs_no_padding():
    k = 5
    payload = [torch.randn(k), torch.arange(k, dtype=torch.int32)]
    assert wire.packed_size(payload, with_header=False) == 8 * k


def test_size_disagreement_between_ranks_is_reported():
    mine = [torch.randn(4)]
    theirs = [torch.randn(6)]
    gathered = torch.cat([wire.pack(mine, False), wire.pack(theirs, False)])
    with pytest.raises(RuntimeError, match="ranks disagree on the payload size of 'w'"):
        wire.unpack_gathered(gathered, mine, 2, False, "w")


def test_empty_payload_is_refused():
    with pytest.raises(ValueError, match="at least one part"):
        wire.pack([], True)


@given(specs=st.lists(st.tuples(part_specs, st.booleans()), min_size=1, max_size=4), world=st.integers(1, 4),
       seed=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_buckets_of_members_round_trip(specs, world, seed):
    """Each rank packs its members back to back; header members may differ in size by rank."""
    rows_of = torch.Generator().manual_seed(seed)
    payloads = []  # [rank][member]
    for r in range(world):
        rank_payloads = []
        for m, (parts, with_header) in enumerate(specs):
            rows = int(torch.randint(0, 5, (), generator=rows_of)) if with_header else 3
            rank_payloads.append([make_part(dtype, rows, trailing, 100 * r + 10 * m + i)
                                  for i, (dtype, trailing) in enumerate(parts)])
        payloads.append(rank_payloads)
    gathered = torch.cat([wire.pack(payloads[r][m], specs[m][1]) for r in range(world) for m in range(len(specs))])
    members = [(payloads[0][m], with_header) for m, (_, with_header) in enumerate(specs)]
    back = wire.unpack_gathered_many(gathered, members, world, "bucket")
    for m in range(len(specs)):
        for r in range(world):
            for a, b in zip(payloads[r][m], back[m][r], strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_truncated_bucket_is_reported():
    payload = [torch.randn(4), torch.arange(4, dtype=torch.int32)]
    buffer = wire.pack(payload, True)
    with pytest.raises(RuntimeError, match="corrupt gather|truncated"):
        wire.unpack_gathered_many(buffer[:-8], [(payload, True)], 1, "b")


@given(columns=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3),
       counts=st.lists(st.lists(st.integers(0, 7), min_size=3, max_size=3), min_size=1, max_size=5),
       world=st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_by_part_layout_round_trips_every_column_over_all_ranks(columns, counts, world):
    """Payload ``m`` has part ``c`` of ``counts[m][c]`` elements; ranks send different contents."""
    def payloads(rank):
        return [[make_part(dtype, n[c], [], seed=100 * rank + 10 * m + c) for c, dtype in enumerate(columns)]
                for m, n in enumerate(counts)]

    layout = wire.columns(payloads(0))
    assert layout is not None and layout.nbytes % 8 == 0
    sizes = [dtype.itemsize for dtype in columns]
    assert layout.nbytes < sum(sum(n[c] for n in counts) * size for c, size in enumerate(sizes)) + 8 * len(columns)
    packed = [wire.pack_columns(payloads(rank), layout) for rank in range(world)]
    assert all(p.numel() == layout.nbytes for p in packed)
    back = wire.unpack_columns(torch.cat(packed), layout, world, "bucket")
    for c, dtype in enumerate(columns):
        want = torch.stack([torch.cat([p[c].reshape(-1) for p in payloads(rank)]) for rank in range(world)])
        assert back[c].dtype == dtype and torch.equal(back[c], want)


def test_by_part_layout_needs_parts_that_line_up_and_ranks_that_agree():
    values, indices = torch.ones(3), torch.arange(3, dtype=torch.int32)
    assert wire.columns([]) is None
    assert wire.columns([[values, indices], [values]]) is None  # different numbers of parts
    assert wire.columns([[values, indices], [values.double(), indices]]) is None  # a column of two dtypes
    layout = wire.columns([[values, indices], [values[:1], indices[:1]]])
    assert layout.offsets == (0, 16) and layout.counts == ((3, 1), (3, 1)) and layout.nbytes == 32
    with pytest.raises(RuntimeError, match="ranks disagree on the payload size of 'b'"):
        wire.unpack_columns(torch.zeros(40, dtype=torch.uint8), layout, 1, "b")


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
