"""How a simulated allreduce adds the ranks' tensors: the one arithmetic the library leaves to the
collective library, reproduced in the order the real one adds.

Floating-point addition is commutative but not associative, so a sum of ``P`` tensors depends on
which partial sums are formed. Measured on CPU tensors with ``scripts/allreduce_order.py`` (which
prints it for any launcher and number of ranks), for 3, 4 and 8 ranks and buffers of 28 bytes to
12 MB, and held to real launches bit for bit by the simulator's tests:

* **Gloo** (``horovodrun --gloo``, and ``torch.distributed``'s Gloo group under ``torchrun``) runs
  its ring allreduce (``gloo/allreduce.cc``): the buffer is cut into ``S`` segments,
  ``S = roundUp(max(ceil(B / M), 2P), P)`` for ``B`` bytes and segments of at most ``M = 1 MiB``,
  each of ``roundUp(ceil(B / S), e)`` bytes (``e`` bytes an element), ``S / P`` consecutive
  segments to a chunk; chunk ``c`` is reduced along the ring from rank ``c - 1`` down to rank ``c``:
  ``((x[c-1] + x[c-2]) + ...) + x[c]``, ranks modulo ``P`` (:func:`gloo_ring`).
* **Open MPI 4.1** (``horovodrun --mpi``) adds by recursive doubling (:func:`recursive_doubling`).
* **In rank order** ``((x0 + x1) + x2) + ...`` (:func:`rank_order`): what the library itself does
  wherever it sums (a gathered payload's aggregate); the simulator's default.

An average divides the sum by ``P`` under ``torch.distributed`` (the library's backend divides on
arrival) and multiplies it by ``1 / P`` under Horovod (its post-scale factor): the same bits when
``P`` is a power of two, not always otherwise. Horovod cannot reduce bfloat16, so the library's
Horovod backend gathers bfloat16 tensors and adds them in float32 in rank order, divides, and rounds
once (``backends/horovod.py``), which the Horovod reductions reproduce.

Horovod fuses allreduces that are in flight at the same time into one buffer (its tensor fusion,
``HOROVOD_FUSION_THRESHOLD``), and Gloo's ring segments are those of the fused buffer: what it
fuses depends on timing. The library launches one allreduce per dtype for a fused bucket, so a
bucket in flight alone is reduced as simulated; tensors sent one by one at the same time (no
buckets, a non-fusable communicator's dense tensors) or several buckets at once may be fused, and
their Gloo sums then agree with the simulated ones within rounding. Recursive doubling adds
element by element whatever the buffer, so Horovod's MPI sums do not depend on the fusion.

Float16 (and torch's bfloat16) sums are formed in that dtype, each addition rounded as a torch ``+``
rounds it; the collective libraries' own 16-bit additions round a small share of sums differently
(about 1 in 500 elements of random data), so those agree with the real ones within the rounding
of a 16-bit sum, as the zoo's cases hold them. Float32 and float64 sums in the matching order are
the real ones bit for bit; integer sums are exact in any order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: ``reduction(tensors, average)``: the sum of every rank's tensor (rank order in the list),
#: divided by their number when ``average``
Reduction = Callable[[Sequence[torch.Tensor], bool], torch.Tensor]

#: Gloo's largest ring segment (``AllreduceOptions::kMaxSegmentSize``).
GLOO_MAX_SEGMENT_BYTES = 1024 * 1024


def _fold(tensors: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    total = tensors[order[0]].clone()
    for rank in order[1:]:
        total += tensors[rank]
    return total


def rank_order(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((x0 + x1) + x2) + ...``."""
    return _fold(tensors, range(len(tensors)))


def recursive_doubling(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Open MPI's recursive doubling: with ``A`` the largest power of two ``<= P`` and ``E = P - A``,
    ranks ``2i`` and ``2i + 1`` (``i < E``) are added first, then the ``A`` partial sums pairwise,
    pairs of pairs and so on: ``(x0 + x1) + (x2 + x3)`` for four ranks, ``(x0 + x1) + x2`` for three."""
    size = len(tensors)
    extra = size - (1 << (size.bit_length() - 1))
    level = [tensors[2 * i].clone().add_(tensors[2 * i + 1]) for i in range(extra)]
    level += [t.clone() for t in tensors[2 * extra:]]
    while len(level) > 1:
        level = [level[i].add_(level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ring_chunks(numel: int, element_size: int, size: int,
                max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> list[int]:
    """Where each of Gloo's ``P`` ring chunks of a ``numel``-element buffer starts (``P + 1``
    element offsets; chunk ``c`` ends up summed on rank ``c``)."""
    total = numel * element_size
    largest = element_size * max(1, max_segment_bytes // element_size)
    segments = _round_up(max((total + largest - 1) // largest, 2 * size), size)
    segment_bytes = _round_up((total + segments - 1) // segments, element_size)
    chunk_bytes = segment_bytes * (segments // size)
    return [min(numel, (c * chunk_bytes + element_size - 1) // element_size) for c in range(size + 1)]


def gloo_ring(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Gloo's ring: chunk ``c`` of the flattened buffer summed from rank ``c - 1`` down to rank ``c``."""
    size = len(tensors)
    flats = [t.reshape(-1) for t in tensors]
    out = torch.empty_like(flats[0])
    bounds = ring_chunks(flats[0].numel(), flats[0].element_size(), size)
    for chunk in range(size):
        start, stop = bounds[chunk], bounds[chunk + 1]
        if start < stop:
            out[start:stop] = _fold([f[start:stop] for f in flats], [(chunk - 1 - k) % size for k in range(size)])
    return out.view(tensors[0].shape)


@dataclass(frozen=True)
class BackendReduction:
    """A real backend's allreduce: its summation order, how it averages (``multiply``: by ``1 / P``,
    else divide by ``P``), and whether bfloat16 goes as the library's Horovod backend sends it
    (gathered, added in float32 in rank order, divided, rounded once)."""

    add: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    multiply: bool = False
    bfloat16_gathered: bool = False

    def __call__(self, tensors: Sequence[torch.Tensor], average: bool) -> torch.Tensor:
        size = len(tensors)
        if self.bfloat16_gathered and tensors[0].dtype == torch.bfloat16:
            total = rank_order([t.float() for t in tensors])
            return (total.div_(size) if average else total).bfloat16()
        total = self.add(tensors)
        if not average:
            return total
        return total.mul_(1.0 / size) if self.multiply else total.div_(size)


#: The reductions a simulated world can use, by name: the library's own order, and each real
#: launcher's CPU allreduce (see the module docstring).
REDUCTIONS: dict[str, BackendReduction] = {
    "rank-order": BackendReduction(rank_order),
    "torch-gloo": BackendReduction(gloo_ring),
    "horovod-gloo": BackendReduction(gloo_ring, multiply=True, bfloat16_gathered=True),
    "horovod-mpi": BackendReduction(recursive_doubling, multiply=True, bfloat16_gathered=True),
}


def resolve_reduction(reduction: str | Reduction) -> Reduction:
    """``reduction`` itself if callable, else the one named in :data:`REDUCTIONS`."""
    if callable(reduction):
        return reduction
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)} or a function (tensors, average) -> tensor, "
                         f"got {reduction!r}")
    return REDUCTIONS[reduction]
