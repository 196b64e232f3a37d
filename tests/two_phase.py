"""An independent reference of the two-phase (scatter-gather) compressed allreduce.

Written from the algorithm's description, not from grace_legacy's ``ShardedExchange``: the tensors
of a bucket laid back to back are cut into ``P`` shards of sizes differing by at most one (the
larger first); each rank compresses every segment (a tensor's part within one shard) as a tensor of
its own; the owner of a shard decodes every rank's payload of each of its segments and combines them
(the rank-ordered sum, divided by ``P`` for an average; a majority vote, ties 0, for signSGD and
Signum), adds its own residual where the compressor is paired with error feedback, encodes the
result with ``compressor.for_sums()`` and keeps what that encoding dropped; every rank decodes the
owners' payloads. Only the compressors' own ``compress``/``decompress`` are the library's (each is
checked against its own reference elsewhere), called on each rank's instance under the same names,
so the random draws match.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grace_legacy import (
    BF16,
    DGC,
    FP16,
    INCEPTIONN,
    QSGD,
    AdaQ,
    DGCMemory,
    EFSignSGD,
    EFSignSGDMemory,
    Natural,
    NoMemory,
    OneBit,
    Residual,
    SignSGD,
    Signum,
    Sketch,
    TernGrad,
    Threshold,
    TopK,
    U8bit,
)


def shards(total: int, world: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each rank's shard of ``total`` elements."""
    out, start = [], 0
    for rank in range(world):
        size = total // world + (1 if rank < total % world else 0)
        out.append((start, start + size))
        start += size
    return out


def pieces(sizes: Sequence[int], world: int) -> list[tuple[int, int, int, int]]:
    """(tensor, start, stop, owner) of every non-empty intersection of a tensor with a shard."""
    out, offset = [], 0
    bounds = shards(sum(sizes), world)
    for index, size in enumerate(sizes):
        for owner, (low, high) in enumerate(bounds):
            start, stop = max(low, offset) - offset, min(high, offset + size) - offset
            if start < stop:
                out.append((index, start, stop, owner))
        offset += size
    return out


class _Segments:
    """Decodes a tensor from its segments' payloads (what a worker's error feedback learns from)."""

    def __init__(self, compressor, shape: torch.Size, parts: list[tuple[int, int, list, object]]) -> None:
        self.compressor, self.shape, self.parts = compressor, shape, parts
        self.traits = compressor.traits

    def decompress(self, payload, ctx) -> torch.Tensor:
        flat = torch.cat([self.compressor.decompress(p, c).reshape(-1) for _, _, p, c in self.parts])
        return flat.view(self.shape)

    def support(self, payload, ctx) -> torch.Tensor:
        return torch.cat([self.compressor.support(p, c).long() + start for start, _, p, c in self.parts])


class TwoPhase:
    """The reference, over steps: ``compressors[r]`` and ``memories[r]`` are rank ``r``'s own
    instances (its error feedback, if any); ``owner_feedback`` keeps the owners' residuals."""

    def __init__(self, compressors: Sequence, memories: Sequence, *, owner_feedback: bool) -> None:
        self.compressors, self.memories = list(compressors), list(memories)
        self.world = len(self.compressors)
        self.owner_feedback = owner_feedback
        self.owner_residual: dict[str, torch.Tensor] = {}

    def step(self, names: Sequence[str], gradients: Sequence[Sequence[torch.Tensor]], average: bool,
             end_step: bool = True) -> list[torch.Tensor]:
        """The synchronized tensors (the same on every rank) from each rank's ``gradients``;
        ``end_step=False`` leaves the memories' step open (more tensors of the step to come)."""
        world = self.world
        compensated = [[self.memories[r].compensate(g.clone(), name) for name, g in zip(names, gradients[r],
                                                                                        strict=True)]
                       for r in range(world)]
        layout = pieces([g.numel() for g in gradients[0]], world)
        sent = [[None] * len(layout) for _ in range(world)]
        for rank in range(world):
            for i, (t, start, stop, _) in enumerate(layout):
                segment = compensated[rank][t].reshape(-1)[start:stop]
                sent[rank][i] = self.compressors[rank].compress(segment, f"{names[t]}[{start}:{stop}]")
        for rank in range(world):
            for t, name in enumerate(names):
                parts = [(start, stop, *sent[rank][i]) for i, (tt, start, stop, _) in enumerate(layout) if tt == t]
                decoder = _Segments(self.compressors[rank], compensated[rank][t].shape, parts)
                payload = [part for _, _, p, _ in parts for part in p]
                self.memories[rank].update(compensated[rank][t], name, decoder, payload, None)
        out = [torch.empty(g.numel(), dtype=g.dtype, device=g.device) for g in gradients[0]]
        for i, (t, start, stop, owner) in enumerate(layout):
            compressor = self.compressors[owner]
            ctx = sent[owner][i][1]
            decoded = [compressor.decompress(sent[rank][i][0], ctx) for rank in range(world)]
            if compressor.traits.aggregates_by_mean:
                total = decoded[0].clone()
                for d in decoded[1:]:
                    total += d
                if average:
                    total /= world
            else:
                votes = sum(torch.sign(d).to(torch.int32) for d in decoded)
                total = torch.sign(votes).to(decoded[0].dtype)
            key = f"{names[t]}[{start}:{stop}]"
            if self.owner_feedback and key in self.owner_residual:
                total = total + self.owner_residual[key]
            encoder = compressor.for_sums()
            payload, ctx2 = encoder.compress(total, f"{key}.sum")
            decoded_sum = encoder.decompress(payload, ctx2)
            if self.owner_feedback:
                self.owner_residual[key] = total - decoded_sum
            out[t][start:stop] = decoded_sum.reshape(-1)
        # What a memory makes of the aggregate (EF-signSGD's 1 / lr); every rank's is the same.
        results = [self.memories[0].aggregated(name, o.view(g.shape))
                   for name, o, g in zip(names, out, gradients[0], strict=True)]
        if end_step:
            for memory in self.memories:
                memory.end_step()
        return results


# -- the cases the library is held to (tests/unit/test_scatter_gather.py, the distributed workers) --

LR = 0.1

#: label -> (compressor, the worker's memory), built afresh for each rank.
SETUPS = {
    "topk+residual": (lambda: TopK(0.2), Residual),
    "topk": (lambda: TopK(0.3), NoMemory),
    "dgc": (lambda: DGC(0.2, seed=4), lambda: DGCMemory(0.9)),
    "threshold": (lambda: Threshold(0.5), Residual),
    "qsgd": (lambda: QSGD(8, seed=3), NoMemory),
    "qsgd+residual": (lambda: QSGD(4, seed=3), Residual),
    "terngrad": (lambda: TernGrad(seed=5), NoMemory),
    "natural": (lambda: Natural(seed=6), NoMemory),
    "signsgd": (SignSGD, NoMemory),
    "signum": (lambda: Signum(0.9), NoMemory),
    "efsignsgd": (lambda: EFSignSGD(LR), lambda: EFSignSGDMemory(LR)),
    "onebit": (OneBit, Residual),
    "fp16": (FP16, NoMemory),
    "bf16": (BF16, NoMemory),
    # GRACE's TensorFlow compressors; min_samples=4 makes AdaQ sample the larger segments' sides.
    "adaq+residual": (lambda: AdaQ(0.3, seed=7, min_samples=4), Residual),
    "inceptionn+residual": (lambda: INCEPTIONN(2**-6), Residual),
    "sketch+residual": (lambda: Sketch(4), Residual),
    "u8bit+residual": (U8bit, Residual),
}

SIZES = {"a": 37, "b": 3, "c": (4, 16), "d": 1}
STEPS = 3


def gradients(world: int, step: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> list[list[torch.Tensor]]:
    out = []
    for rank in range(world):
        g = torch.Generator().manual_seed(1000 * step + rank)
        out.append([torch.randn(size if isinstance(size, tuple) else (size,), generator=g).to(dtype).to(device)
                    for size in SIZES.values()])
    return out


#: The set-ups whose compressor is paired with error feedback: the owners keep residuals of their
#: own unless ``ScatterGather(owner_feedback=False)``.
WITH_OWNER_FEEDBACK = sorted(label for label, (make, _) in SETUPS.items()
                             if not isinstance(make().recommended_memory(), NoMemory))


def reference(label: str, world: int, dtype: torch.dtype, device: torch.device | str = "cpu",
              owner_feedback: bool = True) -> list[list[torch.Tensor]]:
    """``owner_feedback=False``: as ``ScatterGather(owner_feedback=False)``, no owner keeps a residual."""
    make, memory = SETUPS[label]
    compressors = [make() for _ in range(world)]
    for rank, compressor in enumerate(compressors):
        compressor.set_rank(rank)
    owner_feedback = owner_feedback and label in WITH_OWNER_FEEDBACK
    two_phase = TwoPhase(compressors, [memory() for _ in range(world)], owner_feedback=owner_feedback)
    return [two_phase.step(list(SIZES), gradients(world, step, dtype, device), average=True)
            for step in range(STEPS)]


