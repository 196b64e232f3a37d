"""Compiled CPU passes of the 1-bit compressors (docs/DESIGN.md#compiled-passes): one loop packs
each element's bit as :mod:`~grace_legacy.compressors.kernels.bits` lays them out and, when asked,
adds it to its side's sum; one loop decodes the bits straight into the values. Float32 and float64
CPU tensors only. Sums are kept in float64, in lanes within fixed blocks (:func:`pack_and_sum_sides`),
then the blocks in order, so they do not depend on the thread count.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled as _compiled
from grace_legacy.compressors.kernels.bits import packed_length

COMPILED_DTYPES = (torch.float32, torch.float64)
#: Partial sums a block of the sides' pass keeps for each side (a multiple of 8 dividing
#: ``compiled.BLOCK``): enough independent adds in flight for LLVM to fill its vector registers.
LANES = 64


def kernels_apply(tensor: torch.Tensor) -> bool:
    """Whether the compiled loops handle ``tensor``: float32 or float64 on a CPU, while ``compiled.ENABLED``."""
    return _compiled.applies(tensor, COMPILED_DTYPES)


@functools.cache
def _kernels() -> SimpleNamespace:
    import numba

    compiled = _compiled.loop()
    parallel = _compiled.parallel_loop()
    block = _compiled.BLOCK  # a multiple of 8: blocks split no byte
    lanes = LANES
    popcount = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.int64)

    # A `*_range` loop does elements start .. end - 1 (start a multiple of 8); the drivers run one
    # over everything on the calling thread, or one block per prange iteration. Each loops over
    # slices of its range from 0 (compiled.py: why).

    @compiled
    def pack_range(x, out, start, end):  # pragma: no cover - compiled
        x, out, n = x[start:end], out[start // 8:], end - start
        for b in range(n // 8):
            byte = 0
            for k in range(8):
                byte |= (1 if x[8 * b + k] >= 0 else 0) << k
            out[b] = byte
        if n % 8:
            byte = 0
            for i in range(n - n % 8, n):
                byte |= (1 if x[i] >= 0 else 0) << (i % 8)
            out[n // 8] = byte

    @compiled
    def sides_range(x, out, start, end):  # pragma: no cover - compiled
        # Element i of the range is added to lane i % LANES of its side, each lane in element
        # order, then the lanes in order. Each lane's add waits only on that lane's previous one,
        # so LLVM vectorizes across lanes; one running sum would wait on every add (four times
        # slower here). Selects, not branches: numba compiles them to masked adds.
        x, n = x[start:end], end - start
        ups, downs = np.zeros(lanes), np.zeros(lanes)
        for g in range(n // lanes):
            group = x[g * lanes:(g + 1) * lanes]
            for k in range(lanes):
                value = np.float64(group[k])
                nonnegative = value >= 0  # NaN is negative, as in pack
                ups[k] += value if nonnegative else 0.0
                downs[k] += 0.0 if nonnegative else value
        for i in range(n - n % lanes, n):
            value = np.float64(x[i])
            nonnegative = value >= 0
            ups[i % lanes] += value if nonnegative else 0.0
            downs[i % lanes] += 0.0 if nonnegative else value
        pack_range(x, out[start // 8:], 0, n)
        count = 0
        for byte in out[start // 8:(end + 7) // 8]:
            count += popcount[byte]
        up = down = 0.0
        for k in range(lanes):
            up += ups[k]
            down += downs[k]
        return up, down, count

    @compiled
    def momentum_range(previous, gradient, keep, take, out, packed, start, end):  # pragma: no cover - compiled
        # out = previous * keep + gradient * take in out's dtype, as the tensor expression rounds
        # it (each product, then the sum; no fused multiply-add), and its signs packed.
        # Whole bytes first, with a fixed inner trip count (as in `pack_range`), which numba
        # unrolls; a bound that depends on n in the inner loop kept it a slow scalar loop.
        previous, gradient, out, packed = previous[start:end], gradient[start:end], out[start:end], packed[start // 8:]
        n = end - start
        for b in range(n // 8):
            byte = 0
            for k in range(8):
                value = previous[8 * b + k] * keep + out.dtype.type(gradient[8 * b + k]) * take
                out[8 * b + k] = value
                byte |= (1 if value >= 0 else 0) << k
            packed[b] = byte
        if n % 8:
            byte = 0
            for i in range(n - n % 8, n):
                value = previous[i] * keep + out.dtype.type(gradient[i]) * take
                out[i] = value
                byte |= (1 if value >= 0 else 0) << (i % 8)
            packed[n // 8] = byte

    @compiled
    def choose_range(packed, if_set, if_clear, out, start, end):  # pragma: no cover - compiled
        packed, out, n = packed[start // 8:], out[start:end], end - start
        for b in range(n // 8):
            byte = packed[b]
            for k in range(8):
                out[8 * b + k] = if_set if (byte >> k) & 1 else if_clear
        for i in range(n - n % 8, n):
            out[i] = if_set if (packed[i // 8] >> (i % 8)) & 1 else if_clear

    @compiled
    def pack(x, out):  # pragma: no cover - compiled
        pack_range(x, out, 0, x.size)

    @parallel
    def pack_parallel(x, out):  # pragma: no cover - compiled
        for b in numba.prange((x.size + block - 1) // block):
            pack_range(x, out, b * block, min(x.size, (b + 1) * block))

    @compiled
    def sides(x, out):  # pragma: no cover - compiled
        # Block by block, each block's sums added in block order, as the parallel driver does.
        up_total = down_total = 0.0
        count = 0
        for b in range((x.size + block - 1) // block):
            up, down, c = sides_range(x, out, b * block, min(x.size, (b + 1) * block))
            up_total += up
            down_total += down
            count += c
        return up_total, down_total, count

    @parallel
    def sides_parallel(x, out):  # pragma: no cover - compiled
        blocks = (x.size + block - 1) // block
        ups, downs, counts = np.empty(blocks), np.empty(blocks), np.empty(blocks, np.int64)
        for b in numba.prange(blocks):
            ups[b], downs[b], counts[b] = sides_range(x, out, b * block, min(x.size, (b + 1) * block))
        up_total = down_total = 0.0
        for b in range(blocks):
            up_total += ups[b]
            down_total += downs[b]
        return up_total, down_total, counts.sum()

    @compiled
    def momentum_step(previous, gradient, keep, take, out, packed):  # pragma: no cover - compiled
        momentum_range(previous, gradient, keep, take, out, packed, 0, out.size)

    @parallel
    def momentum_step_parallel(previous, gradient, keep, take, out, packed):  # pragma: no cover - compiled
        for b in numba.prange((out.size + block - 1) // block):
            momentum_range(previous, gradient, keep, take, out, packed, b * block, min(out.size, (b + 1) * block))

    @compiled
    def choose(packed, if_set, if_clear, out):  # pragma: no cover - compiled
        choose_range(packed, if_set, if_clear, out, 0, out.size)

    @parallel
    def choose_parallel(packed, if_set, if_clear, out):  # pragma: no cover - compiled
        for b in numba.prange((out.size + block - 1) // block):
            choose_range(packed, if_set, if_clear, out, b * block, min(out.size, (b + 1) * block))

    def both(serial, parallel_driver):
        return SimpleNamespace(serial=serial, parallel=parallel_driver)

    return SimpleNamespace(pack=both(pack, pack_parallel), sides=both(sides, sides_parallel),
                           momentum_step=both(momentum_step, momentum_step_parallel),
                           choose=both(choose, choose_parallel))


def _run(name: str, n: int, *args):
    kernel = getattr(_kernels(), name)
    return _compiled.run(kernel.serial, kernel.parallel, n, *args)


def pack_nonnegative(x: torch.Tensor) -> torch.Tensor:
    """The packed bits of ``x >= 0`` (flat), as :func:`~grace_legacy.compressors.kernels.bits.pack_bits`
    would give them."""
    out = torch.empty(packed_length(x.numel()), dtype=torch.uint8)
    _run("pack", x.numel(), x.reshape(-1).numpy(), out.numpy())
    return out


def pack_and_sum_sides(x: torch.Tensor) -> tuple[torch.Tensor, float, float, int]:
    """``(bits, nonnegative_sum, negative_sum, nonnegative_count)`` of ``x`` (flat): the packed
    bits of ``x >= 0``, the float64 sums of the elements on each side (NaN counts as negative,
    an infinity joins its sign's side), and how many are non-negative. Within each block of
    :data:`~grace_legacy.compressors.kernels.compiled.BLOCK` elements, element ``i`` is added to
    lane ``i % LANES`` of its side, each lane in element order, then the lanes in order; then the
    blocks in order: an order fixed by the element count alone."""
    out = torch.empty(packed_length(x.numel()), dtype=torch.uint8)
    up, down, count = _run("sides", x.numel(), x.reshape(-1).numpy(), out.numpy())
    return out, up, down, count


def choose(packed: torch.Tensor, numel: int, if_set: float, if_clear: float, dtype: torch.dtype) -> torch.Tensor:
    """A flat ``dtype`` (float32 or float64) tensor of ``numel`` elements: ``if_set`` where the
    packed bit is 1, ``if_clear`` where it is 0 (both already values of ``dtype``)."""
    out = torch.empty(numel, dtype=dtype)
    array = out.numpy()
    _run("choose", numel, packed.numpy(), array.dtype.type(if_set), array.dtype.type(if_clear), array)
    return out


def momentum_step(previous: torch.Tensor, gradient: torch.Tensor, momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, bits)``: the new momentum ``previous * momentum + gradient * (1 - momentum)``
    (a fresh tensor in ``previous``'s dtype and shape, rounded as that tensor expression is) and
    the packed bits of ``buffer >= 0``."""
    buffer = torch.empty_like(previous)
    packed = torch.empty(packed_length(buffer.numel()), dtype=torch.uint8)
    work = buffer.numpy().dtype.type
    _run("momentum_step", buffer.numel(), previous.reshape(-1).numpy(), gradient.reshape(-1).numpy(),
         work(momentum), work(1.0 - momentum), buffer.reshape(-1).numpy(), packed.numpy())
    return buffer, packed
