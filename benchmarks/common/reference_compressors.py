"""The straightforward per-tensor compressors the throughput benchmark compares against.

Each makes the torch calls GRACE (Xu et al., 2021; ``grace_dl/torch/compressor/``) makes, in
its order: one tensor at a time, one ``torch.topk`` over the whole tensor for Top-k, a full
``torch.where`` for thresholds, signs as ``uint8`` bytes, no attempt at speed. They are not used
by the library; they only give the benchmark its "per-tensor reference" column, on any device.
Every reference maps a gradient to ``(payload, ctx)`` and back, like
:class:`grace_legacy.core.Compressor`. ``benchmarks/performance/grace_comparison.py`` times them
against GRACE's own code (natural compression aside: GRACE's needs CuPy and a GPU; PowerSGD aside:
GRACE's runs its allreduces inside ``compress``).
"""

from __future__ import annotations

from typing import Any

import torch


class Reference:
    """A per-tensor compressor: :meth:`compress` then :meth:`decompress` (one process, one round)."""

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[list[torch.Tensor], Any]:
        raise NotImplementedError

    def decompress(self, payload: list[torch.Tensor], ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoCompression(Reference):
    def compress(self, tensor, name):
        return [tensor], None

    def decompress(self, payload, ctx):
        return payload[0]


class FP16(Reference):
    def compress(self, tensor, name):
        return [tensor.half()], tensor.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)


class TopK(Reference):
    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def compress(self, tensor, name):
        flat = tensor.flatten()
        k = max(1, int(flat.numel() * self.ratio))
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return [torch.gather(flat, 0, indices), indices], (tensor.shape, flat.numel())

    def decompress(self, payload, ctx):
        values, indices = payload
        shape, numel = ctx
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
        out.scatter_(0, indices, values)
        return out.view(shape)


class RandomK(TopK):
    def compress(self, tensor, name):
        flat = tensor.flatten()
        k = max(1, int(flat.numel() * self.ratio))
        torch.manual_seed(sum(name.encode()))  # GRACE seeds the global generator from the name
        indices = torch.randperm(flat.numel(), device=flat.device)[:k]
        return [flat[indices], indices], (tensor.shape, flat.numel())


class DGC(TopK):
    """GRACE's DGC: a threshold from a 1% sample, adjusted up to ten times until the selection is
    within 30% of k (the number kept is approximate)."""

    def compress(self, tensor, name):
        flat = tensor.flatten()
        numel = flat.numel()
        sample = flat[torch.empty(max(1, int(numel * 0.01)), device=flat.device).uniform_(0, numel).long()]
        threshold = torch.topk(sample.abs(), max(1, int(sample.numel() * self.ratio)))[0].min()
        mask = flat.abs() >= threshold
        selected = int(mask.sum())
        for _ in range(10):
            if selected > 1.3 * numel * self.ratio:
                threshold = 1.3 * threshold
            elif selected < 0.7 * numel * self.ratio:
                threshold = 0.7 * threshold
            else:
                break
            mask = flat.abs() >= threshold
            selected = int(mask.sum())
        (indices,) = torch.where(mask)
        return [flat[indices], indices], (tensor.shape, numel)


class Threshold(TopK):
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def compress(self, tensor, name):
        flat = tensor.flatten()
        (indices,) = torch.where(flat.abs() > self.threshold)
        return [flat[indices], indices], (tensor.shape, flat.numel())


class QSGD(Reference):
    def __init__(self, levels: int) -> None:
        self.levels = levels

    def compress(self, tensor, name):
        norm = tensor.norm()
        level = self.levels / norm * tensor.abs()
        previous = level.floor()
        up = (torch.empty_like(tensor).uniform_() < level - previous).float()
        code = ((previous + up) * tensor.sign()).to(torch.int16)
        return [code.to(torch.int8 if self.levels < 128 else torch.half), norm], tensor.shape

    def decompress(self, payload, ctx):
        code, norm = payload
        return (norm / self.levels * code.float()).view(ctx)


class U8bit(Reference):
    """Dettmers' 8-bit approximation as GRACE's ``u8bit`` makes it (a scale, then each ratio's bin among
    128 sorted values by a binary search, and a gather back), over the dynamic tree's midpoints."""

    def __init__(self) -> None:
        from grace_legacy.compressors.u8bit import dynamic_tree_table

        table = dynamic_tree_table()
        self.table = torch.tensor([float(t) for t in table])
        self.midpoints = torch.tensor([float((a + b) / 2) for a, b in zip(table, table[1:], strict=False)])

    def compress(self, tensor, name):
        scale = tensor.abs().max()
        midpoints = self.midpoints.to(tensor.device)
        codes = torch.searchsorted(midpoints, (tensor.abs() / scale).reshape(-1)).to(torch.uint8)
        return [codes | ((tensor.reshape(-1) < 0).to(torch.uint8) << 7), scale], tensor.shape

    def decompress(self, payload, ctx):
        codes, scale = payload
        magnitude = self.table.to(codes.device)[(codes & 127).long()] * scale
        return torch.where(codes >= 128, -magnitude, magnitude).view(ctx)


class TernGrad(Reference):
    def compress(self, tensor, name):
        std = torch.sqrt(torch.mean((tensor - tensor.mean()) ** 2))
        c = 2.5 * std.item()
        clipped = torch.clamp(tensor, -c, c)
        magnitude = clipped.abs()
        scalar = magnitude.max()
        signs = clipped.sign() * scalar
        signs[torch.empty_like(tensor).uniform_(0, scalar.item()) >= magnitude] = 0
        return [signs.sign().to(torch.int8), scalar.flatten()], tensor.shape

    def decompress(self, payload, ctx):
        code, scalar = payload
        return (code.float() * scalar).view(ctx)


class Natural(Reference):
    """Stochastic rounding of each magnitude to a power of two, kept as an 8-bit exponent."""

    def compress(self, tensor, name):
        bits = tensor.flatten().view(torch.int32)
        sign = bits & -(2**31)
        exponent = bits & 0x7F80_0000
        mantissa = bits & 0x007F_FFFF
        round_up = mantissa > torch.randint(0, 0x007F_FFFF, bits.shape, dtype=torch.int32, device=bits.device)
        exponent = torch.where(round_up, exponent + 0x0080_0000, exponent)
        exponent = torch.clamp(exponent, 0x0900_0000, 0x4880_0000) >> 23
        code = ((sign >> 24) & 0x80) | (exponent - 18)
        return [code.to(torch.uint8)], tensor.shape

    def decompress(self, payload, ctx):
        code = payload[0]
        negative = code > 127
        exponent = (code & 0x7F).to(torch.int32)
        floats = ((exponent + 18) << 23).view(torch.float32)
        floats = torch.where(negative, -floats, floats) * (exponent >= 1).float()
        return floats.view(ctx)


class SignSGD(Reference):
    def compress(self, tensor, name):
        return [(tensor.flatten() >= 0).to(torch.uint8)], tensor.shape

    def decompress(self, payload, ctx):
        return (payload[0].float() * 2 - 1).view(ctx)


class Signum(SignSGD):
    def __init__(self, momentum: float = 0.9) -> None:
        self.momentum = momentum
        self.state: dict[str, torch.Tensor] = {}

    def compress(self, tensor, name):
        previous = self.state.get(name)
        m = tensor if previous is None else (1 - self.momentum) * tensor + self.momentum * previous
        self.state[name] = m
        return super().compress(m, name)


class EFSignSGD(Reference):
    def compress(self, tensor, name):
        flat = tensor.flatten()
        return [(flat >= 0).to(torch.uint8), flat.abs().mean()], tensor.shape

    def decompress(self, payload, ctx):
        signs, mean = payload
        return ((signs.float() * 2 - 1) * mean).view(ctx)


class OneBit(Reference):
    def compress(self, tensor, name):
        flat = tensor.flatten()
        negative = flat < 0
        sum0 = flat[negative].sum()
        count0 = negative.sum().float()
        mean0 = sum0 / count0 if count0 > 0 else sum0
        positive = ~negative
        sum1 = flat[positive].sum()
        count1 = flat.numel() - count0
        mean1 = sum1 / count1 if count1 > 0 else sum1
        return [negative.to(torch.uint8), mean0, mean1], tensor.shape

    def decompress(self, payload, ctx):
        negative, mean0, mean1 = payload
        negative = negative.bool()
        return (negative * mean0 + ~negative * mean1).view(ctx)


class PowerSGD(Reference):
    """Rank-``r`` power iteration with a Gram-Schmidt loop, warm-started ``Q`` per tensor; tensors
    of fewer than 2 dimensions are sent as they are."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.q: dict[str, torch.Tensor] = {}

    def compress(self, tensor, name):
        if tensor.dim() < 2:
            return [tensor], None
        matrix = tensor.view(tensor.shape[0], -1)
        rank = min(self.rank, *matrix.shape)
        q = self.q.get(name)
        if q is None:
            q = self.q[name] = torch.randn(matrix.shape[1], rank, device=tensor.device)
        p = matrix @ q
        for i in range(rank):
            column = p[:, i]
            for j in range(i):
                column -= (column @ p[:, j]) * p[:, j]
            column /= column.norm() + 1e-8
        q = matrix.t() @ p
        self.q[name] = q
        return [p, q], tensor.shape

    def decompress(self, payload, ctx):
        if ctx is None:
            return payload[0]
        p, q = payload
        return (p @ q.t()).view(ctx)


# -- the LEGACY reference's own compressors -------------------------------------------------------
# GlobalTopK and CAT select over the whole model: the benchmark hands them the step's gradients
# laid end to end (``spans_step``), as the library's bundle does.


class GlobalTopK(TopK):
    """One ``torch.topk`` over the model's gradients end to end (the LEGACY reference's
    ``GlobalTopKReducer``)."""

    spans_step = True


class CAT(TopK):
    """The whole model's magnitudes sorted, the squared norm's running sum, the packet count with
    the best ratio of it to ``c0 m + c1``, then a ``torch.topk`` of that many (the LEGACY
    reference's ``GlobalCATReducer``, with whole packets)."""

    spans_step = True

    def __init__(self, c0: float = 1.0, c1: float = 60.0, packet_bits: int = 1460) -> None:
        super().__init__(1.0)
        self.c0, self.c1, self.packet_bits = c0, c1, packet_bits

    def compress(self, tensor, name):
        flat = tensor.flatten()
        n, tau = flat.numel(), max(1, self.packet_bits // 64)
        sums = torch.sort(flat.abs(), descending=True).values.double().square().cumsum(0)
        packets = torch.arange(1, -(-n // tau) + 1, dtype=torch.float64, device=flat.device)
        ends = (packets.long() * tau).clamp(max=n) - 1
        k = int(ends[torch.argmax(sums[ends] / (self.c0 * packets + self.c1))]) + 1
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return [torch.gather(flat, 0, indices), indices], (tensor.shape, n)


class AdaComp(TopK):
    """Per tensor a residue ``R``: ``G = R + g``, ``H = G + g``, each bin's ``max |G|`` by a view of
    the padded magnitudes, sent where ``|H|`` reaches it, ``R`` = ``G`` with those zeroed."""

    def __init__(self, bin_size: int) -> None:
        super().__init__(1.0)
        self.bin_size = bin_size
        self.residues: dict[str, torch.Tensor] = {}

    def compress(self, tensor, name):
        flat = tensor.flatten()
        g = self.residues.get(name, torch.zeros_like(flat)) + flat
        h = g + flat
        size = min(self.bin_size, g.numel())
        padded = torch.nn.functional.pad(g.abs(), (0, -g.numel() % size))
        top = padded.view(-1, size).amax(dim=1).repeat_interleave(size)[:g.numel()]
        mask = h.abs() >= top
        indices = torch.nonzero(mask).flatten()
        self.residues[name] = torch.where(mask, torch.zeros_like(g), g)
        return [g[indices], indices], (tensor.shape, flat.numel())


class SquaredOnce:
    """A moment source (for the library's ``attach`` and the reference alike) that squares each
    named gradient once and hands that back every time: the moments cost neither side."""

    def __init__(self) -> None:
        self.moments: dict[str, torch.Tensor] = {}

    def take(self, name: str, gradient: torch.Tensor) -> torch.Tensor:
        if name not in self.moments:
            self.moments[name] = gradient.square()
        return self.moments[name]

    def clear(self) -> None:
        pass


class Variance(TopK):
    """Per tensor sums ``r``, ``v``: ``r += g``, ``v += m``, sent where ``r^2 > alpha v``; there
    ``r`` and ``v`` are zeroed, elsewhere ``v`` decays by ``ksi``."""

    def __init__(self, alpha: float, ksi: float, moments: SquaredOnce) -> None:
        super().__init__(1.0)
        self.alpha, self.ksi, self.source = alpha, ksi, moments
        self.sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def compress(self, tensor, name):
        flat = tensor.flatten()
        r, v = self.sums.get(name, (torch.zeros_like(flat), torch.zeros_like(flat)))
        r = r + flat
        v = v + self.source.take(name, tensor).flatten()
        mask = r * r > self.alpha * v
        indices = torch.nonzero(mask).flatten()
        values = r[indices]
        zero = torch.zeros_like(r)
        self.sums[name] = (torch.where(mask, zero, r), torch.where(mask, zero, self.ksi * v))
        return [values, indices], (tensor.shape, flat.numel())
