"""What worker scripts share: argument parsing, a check recorder, and reference math.

The reference functions here are written independently of grace_legacy (sorting instead of
``torch.topk``, dense masks instead of scatters) so that a test compares two implementations.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import itertools
import json
import math
import traceback
from fractions import Fraction
from pathlib import Path

import horovod.torch as hvd
import torch

from grace_legacy.backends.horovod import synchronize


def parse_args(extra=None) -> argparse.Namespace:
    """The worker's arguments. Called first thing, after the imports: so it also freezes what the
    imports made (see ``tests/conftest.py``), which the rank's collections need not walk again."""
    gc.freeze()
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for args, kwargs in extra or []:
        parser.add_argument(*args, **kwargs)
    return parser.parse_args()


class Recorder:
    """Collects named pass/fail checks and writes them to ``<out>/rank<r>.json``; ``rank`` is
    Horovod's unless given (torchrun workers give torch.distributed's)."""

    def __init__(self, out: Path, rank: int | None = None) -> None:
        self.out = out
        self.rank = rank
        self.checks: list[dict] = []
        self.extra: dict = {}

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})

    def close(self, actual: torch.Tensor, expected: torch.Tensor, name: str, rtol=1e-6, atol=1e-7) -> None:
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        except AssertionError as err:
            self.check(name, False, str(err)[:1500])
        else:
            self.check(name, True)

    def equal(self, actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
        same = actual.shape == expected.shape and torch.equal(actual, expected)
        self.check(name, same, "" if same else f"max |diff| {(actual - expected).abs().max().item():.3e}")

    def guard(self, name: str, fn, *args, **kwargs):
        """Run ``fn``; an exception becomes a failed check instead of a crashed rank."""
        try:
            return fn(*args, **kwargs)
        except Exception:
            self.check(name, False, traceback.format_exc()[-1500:])
            return None

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"rank{hvd.rank() if self.rank is None else self.rank}.json"
        path.write_text(json.dumps({"checks": self.checks, **self.extra}, indent=1))


_reference_calls = itertools.count()


def gather_from_ranks(tensor: torch.Tensor, process_set=None) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor``, through a plain (uncompressed) Horovod allgather.

    Workers call this in the same order on every rank, so a call counter names it consistently.
    Horovod has no bfloat16: those travel as their bits (int16) and are viewed back.
    """
    process_set = process_set or hvd.global_process_set
    rows = tensor.detach().reshape(1, -1).clone()
    bits = rows.dtype == torch.bfloat16
    handle = hvd.allgather_async(rows.view(torch.int16) if bits else rows, name=f"reference.{next(_reference_calls)}",
                                 process_set=process_set)
    stacked = synchronize(handle)  # asleep: hvd.synchronize spins, taking the core of a rank still computing
    return [(row.view(torch.bfloat16) if bits else row).view(tensor.shape) for row in stacked]


def kept(ratio: float, numel: int) -> int:
    return max(1, math.floor(Fraction(repr(ratio)) * numel))


def topk_reference(tensor: torch.Tensor, ratio: float) -> torch.Tensor:
    """Dense tensor keeping the k largest magnitudes of ``tensor`` (by a full sort)."""
    flat = tensor.reshape(-1)
    k = kept(ratio, flat.numel())
    order = torch.sort(flat.abs(), descending=True, stable=True).indices
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[order[:k]] = True
    return torch.where(mask, flat, torch.zeros_like(flat)).view(tensor.shape)


def randomk_indices_reference(seed: int, name: str, step: int, numel: int, ratio: float) -> torch.Tensor:
    """The documented Random-k rule, from a generator seeded by blake2b(seed, name, step): the
    first k of a randperm when k > numel / 4, else the first k distinct values of a stream of
    randint draws (k + 2k^2/n + 64 of them, topped up by 2m + 64 while m are missing)."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{step}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    k = kept(ratio, numel)
    if 4 * k > numel:
        return torch.randperm(numel, generator=generator)[:k]
    stream = torch.randint(numel, (k + 2 * k * k // numel + 64,), generator=generator).tolist()
    chosen: list[int] = []
    seen: set[int] = set()
    position = 0
    while len(chosen) < k:
        if position == len(stream):
            stream += torch.randint(numel, (2 * (k - len(chosen)) + 64,), generator=generator).tolist()
        value = stream[position]
        position += 1
        if value not in seen:
            seen.add(value)
            chosen.append(value)
    return torch.tensor(chosen, dtype=torch.int64)


def mean_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros_like(tensors[0])
    for t in tensors:
        total = total + t
    return total / len(tensors)


def gathered_goes_dense(packed_bytes: int, numel: int, world: int, element_size: int = 4) -> bool:
    """The documented dense fallback, written out: a gathered payload of ``packed_bytes`` is sent
    dense when it is at least the dense size times min(1, 2 / world)."""
    dense = numel * element_size
    return packed_bytes * world >= 2 * dense if world > 2 else packed_bytes >= dense


def topk_goes_dense(numel: int, ratio: float, world: int) -> bool:
    """Top-k of fp32 sends k fp32 values and k int32 indices: 8k bytes, already 8-byte aligned."""
    return gathered_goes_dense(8 * kept(ratio, numel), numel, world)


def topk_contribution(tensor: torch.Tensor, ratio: float, world: int) -> torch.Tensor:
    """What a rank contributes under Top-k: its top-k, or the whole tensor where the dense
    fallback applies."""
    return tensor if topk_goes_dense(tensor.numel(), ratio, world) else topk_reference(tensor, ratio)
