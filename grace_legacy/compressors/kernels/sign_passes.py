"""The 1-bit compressors' passes (:mod:`~grace_legacy.compressors.signs`): each element's bit
``x >= 0`` packed as :mod:`~grace_legacy.compressors.kernels.bits` lays them out (NaN reads as
negative, ``-0.0`` as non-negative), the sums of each side, Signum's momentum step, and the decode
that puts one of two values at each bit.

Each is written twice: the torch formula, which every device other than the CPU runs (and fp16
and bf16 gradients everywhere), and loops compiled by numba for float32 and float64 that pack
the bits as they read and sum each side in the same pass; the function named after the pass
picks one (docs/DESIGN.md#compiled-passes). The bits and Signum's momentum are the same bits
either way. The sides' sums are not: the loops keep them in float64, in lanes within fixed blocks
(:func:`pack_and_sum_sides`), then the blocks in order, so they do not depend on the thread count;
the formula sums in the accumulator dtype (:func:`accumulator_dtype`), on the device, without a
synchronization.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from grace_legacy.compressors.kernels import compiled
from grace_legacy.compressors.kernels.bits import pack_bits, packed_length, unpack_bits
from grace_legacy.runtime import paths

BLOCK = compiled.BLOCK  # a multiple of 8: blocks split no byte
COMPILED_DTYPES = (torch.float32, torch.float64)
#: Partial sums a block of the sides' pass keeps for each side (a multiple of 8 dividing
#: ``compiled.BLOCK``): enough independent adds in flight for LLVM to fill its vector registers.
LANES = 64
_POPCOUNT = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.int64)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision gradients (an fp16 sum overflows at 65504), else the dtype itself."""
    return torch.promote_types(dtype, torch.float32)


def _compiled_for(tensor: torch.Tensor) -> bool:
    return compiled.applies(tensor, COMPILED_DTYPES)


def pack_nonnegative(x: torch.Tensor) -> torch.Tensor:
    """The packed bits of ``x >= 0`` (flat): a compiled loop on a CPU, else ``pack_bits``."""
    if not _compiled_for(x):
        return pack_bits(x.reshape(-1) >= 0)
    out = torch.empty(packed_length(x.numel()), dtype=torch.uint8)
    compiled.run(_pack, _pack_parallel, x.numel(), x.reshape(-1).numpy(), out.numpy())
    return out


def side_means(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit SGD's ``(bits, means)`` of flat ``x``: the packed bits of ``x >= 0`` and, in ``x``'s
    dtype, ``[mean{x_i : x_i >= 0}, mean{x_i : x_i < 0}]`` (0 for an empty side)."""
    if _compiled_for(x):
        packed, up, down, count = pack_and_sum_sides(x)
        means = torch.tensor([up / max(count, 1), down / max(x.numel() - count, 1)], dtype=x.dtype)
        return packed, means
    nonnegative = x >= 0
    wide = x.to(accumulator_dtype(x.dtype))
    zero = wide.new_zeros(())
    sums = torch.stack([torch.where(nonnegative, wide, zero).sum(), torch.where(nonnegative, zero, wide).sum()])
    count = nonnegative.sum()
    # A side with no entry has sum 0; dividing by 1 makes its mean 0 without a branch (no sync).
    counts = torch.stack([count, x.numel() - count]).clamp(min=1)
    return pack_bits(nonnegative), (sums / counts).to(x.dtype)


def mean_magnitude(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """EF-signSGD's ``(bits, scale)`` of flat ``x``: the packed bits of ``x >= 0`` and
    ``[||x||_1 / n]`` in ``x``'s dtype (a NaN or an inf carried on)."""
    if _compiled_for(x):
        packed, nonnegative, negative, _ = pack_and_sum_sides(x)
        return packed, torch.tensor([(nonnegative - negative) / x.numel()], dtype=x.dtype)
    scale = torch.mean(x.abs(), dtype=accumulator_dtype(x.dtype)).to(x.dtype).reshape(1)
    return pack_bits(x >= 0), scale


def pack_and_sum_sides(x: torch.Tensor) -> tuple[torch.Tensor, float, float, int]:
    """``(bits, nonnegative_sum, negative_sum, nonnegative_count)`` of float32 or float64 CPU tensor
    ``x`` (flat), by the compiled loops: the packed bits of ``x >= 0``, the float64 sums of the
    elements on each side (NaN counts as negative, an infinity joins its sign's side), and how many
    are non-negative. Within each block of :data:`BLOCK` elements, element ``i`` is added to lane
    ``i % LANES`` of its side, each lane in element order, then the lanes in order; then the blocks
    in order: an order fixed by the element count alone."""
    out = torch.empty(packed_length(x.numel()), dtype=torch.uint8)
    up, down, count = compiled.run(_sides, _sides_parallel, x.numel(), x.reshape(-1).numpy(), out.numpy())
    return out, up, down, count


def momentum_step(previous: torch.Tensor, gradient: torch.Tensor, momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Signum's ``(buffer, bits)``: the new momentum ``previous * momentum + gradient * (1 - momentum)``
    (a fresh tensor in ``previous``'s dtype and shape, each product rounded, then the sum, as the
    tensor expression is) and the packed bits of ``buffer >= 0``. A compiled loop for float32 and
    float64 CPU tensors, else the tensor expression."""
    if not (_compiled_for(gradient) and previous.is_contiguous()):
        buffer = previous * momentum + gradient.to(previous.dtype) * (1.0 - momentum)
        return buffer, pack_nonnegative(buffer)
    buffer = torch.empty_like(previous)
    packed = torch.empty(packed_length(buffer.numel()), dtype=torch.uint8)
    work = buffer.numpy().dtype.type
    compiled.run(_momentum_step, _momentum_step_parallel, buffer.numel(), previous.reshape(-1).numpy(),
                 gradient.reshape(-1).numpy(), work(momentum), work(1.0 - momentum), buffer.reshape(-1).numpy(),
                 packed.numpy())
    return buffer, packed


def choose(packed: torch.Tensor, numel: int, if_set: torch.Tensor, if_clear: torch.Tensor) -> torch.Tensor:
    """A flat tensor of ``numel`` elements: ``if_set`` where the packed bit is 1, ``if_clear``
    where it is 0 (0-dim tensors of the result's dtype). A compiled loop for float32 and float64 on
    a CPU, else ``torch.where`` over the unpacked bits."""
    if not (_compiled_for(if_set) and paths.cpu_path(packed)):
        return torch.where(unpack_bits(packed, numel), if_set, if_clear)
    out = torch.empty(numel, dtype=if_set.dtype)
    array = out.numpy()
    compiled.run(_choose, _choose_parallel, numel, packed.numpy(), array.dtype.type(if_set.item()),
                 array.dtype.type(if_clear.item()), array)
    return out


# A `_*_range` loop does elements start .. end - 1 (start a multiple of 8); the drivers run one
# over everything on the calling thread, or one block per prange iteration.
@compiled.loop
def _pack_range(x, out, start, end):  # pragma: no cover - compiled
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


@compiled.loop
def _pack(x, out):  # pragma: no cover - compiled
    _pack_range(x, out, 0, x.size)


@compiled.parallel_loop
def _pack_parallel(x, out):  # pragma: no cover - compiled
    for b in numba.prange((x.size + BLOCK - 1) // BLOCK):
        _pack_range(x, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))


@compiled.loop
def _sides_range(x, out, start, end):  # pragma: no cover - compiled
    # Element i of the range is added to lane i % LANES of its side, each lane in element
    # order, then the lanes in order. Each lane's add waits only on that lane's previous one,
    # so LLVM vectorizes across lanes; one running sum would wait on every add (four times
    # slower here). Selects, not branches: numba compiles them to masked adds.
    x, n = x[start:end], end - start
    ups, downs = np.zeros(LANES), np.zeros(LANES)
    for g in range(n // LANES):
        group = x[g * LANES:(g + 1) * LANES]
        for k in range(LANES):
            value = np.float64(group[k])
            nonnegative = value >= 0  # NaN is negative, as in _pack_range
            ups[k] += value if nonnegative else 0.0
            downs[k] += 0.0 if nonnegative else value
    for i in range(n - n % LANES, n):
        value = np.float64(x[i])
        nonnegative = value >= 0
        ups[i % LANES] += value if nonnegative else 0.0
        downs[i % LANES] += 0.0 if nonnegative else value
    _pack_range(x, out[start // 8:], 0, n)
    count = 0
    for byte in out[start // 8:(end + 7) // 8]:
        count += _POPCOUNT[byte]
    up = down = 0.0
    for k in range(LANES):
        up += ups[k]
        down += downs[k]
    return up, down, count


@compiled.loop
def _sides(x, out):  # pragma: no cover - compiled
    # Block by block, each block's sums added in block order, as the parallel driver does.
    up_total = down_total = 0.0
    count = 0
    for b in range((x.size + BLOCK - 1) // BLOCK):
        up, down, c = _sides_range(x, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))
        up_total += up
        down_total += down
        count += c
    return up_total, down_total, count


@compiled.parallel_loop
def _sides_parallel(x, out):  # pragma: no cover - compiled
    blocks = (x.size + BLOCK - 1) // BLOCK
    ups, downs, counts = np.empty(blocks), np.empty(blocks), np.empty(blocks, np.int64)
    for b in numba.prange(blocks):
        ups[b], downs[b], counts[b] = _sides_range(x, out, b * BLOCK, min(x.size, (b + 1) * BLOCK))
    up_total = down_total = 0.0
    for b in range(blocks):
        up_total += ups[b]
        down_total += downs[b]
    return up_total, down_total, counts.sum()


@compiled.loop
def _momentum_range(previous, gradient, keep, take, out, packed, start, end):  # pragma: no cover - compiled
    # out = previous * keep + gradient * take in out's dtype, as the tensor expression rounds
    # it (each product, then the sum; no fused multiply-add), and its signs packed.
    # Whole bytes first, with a fixed inner trip count (as in `_pack_range`), which numba
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


@compiled.loop
def _momentum_step(previous, gradient, keep, take, out, packed):  # pragma: no cover - compiled
    _momentum_range(previous, gradient, keep, take, out, packed, 0, out.size)


@compiled.parallel_loop
def _momentum_step_parallel(previous, gradient, keep, take, out, packed):  # pragma: no cover - compiled
    for b in numba.prange((out.size + BLOCK - 1) // BLOCK):
        _momentum_range(previous, gradient, keep, take, out, packed, b * BLOCK, min(out.size, (b + 1) * BLOCK))


@compiled.loop
def _choose_range(packed, if_set, if_clear, out, start, end):  # pragma: no cover - compiled
    packed, out, n = packed[start // 8:], out[start:end], end - start
    for b in range(n // 8):
        byte = packed[b]
        for k in range(8):
            out[8 * b + k] = if_set if (byte >> k) & 1 else if_clear
    for i in range(n - n % 8, n):
        out[i] = if_set if (packed[i // 8] >> (i % 8)) & 1 else if_clear


@compiled.loop
def _choose(packed, if_set, if_clear, out):  # pragma: no cover - compiled
    _choose_range(packed, if_set, if_clear, out, 0, out.size)


@compiled.parallel_loop
def _choose_parallel(packed, if_set, if_clear, out):  # pragma: no cover - compiled
    for b in numba.prange((out.size + BLOCK - 1) // BLOCK):
        _choose_range(packed, if_set, if_clear, out, b * BLOCK, min(out.size, (b + 1) * BLOCK))
