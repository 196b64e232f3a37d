"""Every compiled pass that promises its torch reference's bits gives them, at one thread and at
two (``grace_legacy/compressors/kernels/``: each module's ``*_reference`` formula, which a GPU
runs, beside its loops): QSGD's levels and their decoding, TernGrad's digits, Natural's code bytes
and their decoding, the sign passes (packing, Signum's momentum step, the decode), the sparse
decode's scatter, and Threshold's entries.

The inputs are the awkward ones: signed zeros, subnormals, the largest finite values, infinities
and NaN (where the pass takes them), gradients that were float16 or bfloat16 (the quantizers work
on them in float32), empty tensors where a pass can meet one, and lengths at the blocks' edges (a
lone last element, a partial byte, a block and one, three blocks with a ragged last one), with the
blocks spread over two threads by lowering the size a thread is given. The passes whose sums
differ from torch's in their order (QSGD's norm, TernGrad's spread, the 1-bit scalars, PowerSGD's
products) are held to their documented orders elsewhere (``test_stochastic.py``,
``test_sign_passes.py``, ``test_threads.py``)."""

from __future__ import annotations

import pytest
import torch

from grace_legacy.compressors.kernels import (
    compiled,
    natural_passes,
    qsgd_passes,
    scatter,
    sign_passes,
    terngrad_passes,
    threshold_passes,
)
from grace_legacy.compressors.kernels.bits import pack_bits, unpack_bits
from grace_legacy.compressors.quantization import float32_at_least
from grace_legacy.runtime import paths

SOURCES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: A lone element, odd and partial-byte lengths, a block and one, three blocks with a ragged last one.
LENGTHS = [1, 7, 67, compiled.BLOCK + 1, 2 * compiled.BLOCK + 3]
THREADS = [1, 2]
#: Keys with the top bit set and negative ones: the draws take them modulo 2**64.
KEYS = [2**63 + 12345, -5]


def awkward(n: int, source: torch.dtype, finite: bool, seed: int = 0) -> torch.Tensor:
    """``n`` values of ``source`` in their work dtype (float64 stays, the rest become float32): a
    spread of magnitudes, with signed zeros, the least subnormal and the largest finite value of the
    source dtype, and (unless ``finite``) infinities and NaN sprinkled in."""
    work = torch.float64 if source == torch.float64 else torch.float32
    if n == 0:
        return torch.empty(0, dtype=work)
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (n,), generator=g))
    info = torch.finfo(source)
    x.clamp_(-info.max, info.max)  # float16 overflows at 65504: infinities only where asked for
    specials = [0.0, -0.0, info.smallest_normal * 2**-3, -info.tiny, info.max, -info.max, 1.0, -1.0]
    if not finite:
        specials += [float("inf"), float("-inf"), float("nan")]
    where = torch.randint(0, n, (min(n, 4 * len(specials)),), generator=g)
    x[where] = torch.tensor(specials, dtype=torch.float64).repeat(len(where) // len(specials) + 1)[: len(where)]
    return x.to(source).to(work)


def same_bits(got, want) -> None:
    """Tensors, or tuples of them, of the same dtypes, shapes and bytes (NaN's included)."""
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))


@pytest.fixture
def both_ways(monkeypatch):
    """``both_ways(function, *args)``: what ``function(*args)`` gives along the device path (the
    torch references), then the same bits from the compiled passes on each of :data:`THREADS` threads (any pass over
    two elements or more gets two: the size a thread is given is lowered to one element)."""
    monkeypatch.setattr(compiled, "PER_THREAD", 1)
    threads = [t for t in THREADS if t <= compiled.pool_size()]  # a one-thread pool cannot run two

    def compare(function, *args):
        with paths.device_path(True):
            want = function(*args)
        before = torch.get_num_threads()
        try:
            for count in threads:
                torch.set_num_threads(count)
                assert compiled.threads_for(2) == count
                same_bits(function(*args), want)
        finally:
            torch.set_num_threads(before)

    return compare


@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_qsgd_levels_and_their_decoding(source, both_ways):
    for n in [0, *LENGTHS]:
        x = awkward(n, source, finite=True)
        # Any finite positive norm: the formula clamps the ratios (an unusable one is never passed).
        norm = float32_at_least(qsgd_passes.norm(x)) if n else 1.0
        norm = norm if 0 < norm < float("inf") else 3e38
        for s, key in [(1, KEYS[0]), (127, KEYS[1]), (40_000, KEYS[0])]:
            dtype = torch.int8 if s <= 127 else torch.int32
            both_ways(qsgd_passes.levels, x, norm, s, key, dtype)
            codes = qsgd_passes.levels(x, norm, s, key, dtype)
            scale = torch.tensor([norm], dtype=torch.float32)
            both_ways(qsgd_passes.decoded, codes, scale, s, x.dtype)


@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_terngrad_digits(source, both_ways):
    for n in [0, *LENGTHS]:
        x = awkward(n, source, finite=True)
        for bound, key in [(float("inf"), KEYS[0]), (0.5, KEYS[1])]:
            scale = float32_at_least(min(float(x.abs().max()) if n else 1.0, bound)) or 1.0
            both_ways(terngrad_passes.digits, x, bound, scale, key)


@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_natural_codes_and_their_decoding(source, both_ways):
    for n in LENGTHS:  # a gradient is never empty: the codes' top needs an element
        for finite in (True, False):
            x = awkward(n, source, finite)
            if n > 2:  # a subnormal, or a value some 2^126 under the largest: the loops' rare branch
                x[1] = 2.0**-1000 if x.dtype == torch.float64 else 1e-44
            for key in KEYS:
                both_ways(natural_passes.codes, x, key)
            top, codes = natural_passes.codes(x, KEYS[0])
            both_ways(natural_passes.decoded, top, codes, x.dtype, source)
    empty = torch.empty(0, dtype=torch.uint8)
    both_ways(natural_passes.decoded, torch.tensor([3], dtype=torch.int16), empty, torch.float32, source)


@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_sign_packing_momentum_and_decoding(source, both_ways):
    """Half-precision gradients take the tensor path on every device; their momentum (float32)
    and its signs take the compiled one on a CPU."""
    for n in [0, *LENGTHS]:
        x = awkward(n, source, finite=False).to(source)
        previous = awkward(n, torch.float32 if source != torch.float64 else source, finite=False, seed=1)
        both_ways(sign_passes.pack_nonnegative, x)
        both_ways(sign_passes.momentum_step, previous, x, 0.9)
        packed = pack_bits(x >= 0)
        one = torch.ones((), dtype=source)
        assert torch.equal(unpack_bits(sign_passes.pack_nonnegative(x), n), x >= 0)
        both_ways(sign_passes.choose, packed, n, one, -one)
        both_ways(sign_passes.choose, packed, n, torch.tensor(-0.0, dtype=source),
                  torch.tensor(float("nan"), dtype=source))


def scattered(numel: int, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(numel, dtype=values.dtype)
    scatter.put(out, indices, values)
    return out


@pytest.mark.parametrize("source", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_sparse_scatter(source, index_dtype, both_ways):
    """Distinct indices, in order and shuffled (a repeated index has no one answer in ``scatter_``;
    the compiled pass's is in ``test_sparse.py``)."""
    for n in [0, *LENGTHS]:
        values = awkward(n, source, finite=False)
        numel = 3 * n + 5
        g = torch.Generator().manual_seed(n)
        increasing = torch.randperm(numel, generator=g)[:n].sort().values.to(index_dtype)
        for indices in (increasing, increasing[torch.randperm(n, generator=g)]):
            both_ways(scattered, numel, indices, values)


@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_threshold_entries(source, both_ways):
    """Above :data:`~grace_legacy.compressors.kernels.selection.SMALL` entries the compiled pass,
    below it the reference on both ways: the lengths here reach past it."""
    for n in [0, *LENGTHS, 3 * compiled.BLOCK + 37]:
        x = awkward(n, source, finite=False).to(source)
        for threshold in (1e-30, 0.5, 3.0, 1e30):
            both_ways(threshold_passes.entries_at_or_above, x, threshold, torch.int32)
