"""Catching ranks that disagree, before they exchange a single gradient.

Ranks that run different models, compressors or schedules would otherwise send collectives that
never match (a hang) or that match by accident (a silently wrong gradient). Each rank hashes a
description of its set-up, one small allgather compares the hashes, and only on a mismatch do the
ranks exchange the descriptions themselves, so that every rank raises the same error naming
what differs and which ranks differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from grace_legacy import wire
from grace_legacy.core import Backend, derived_seed


class RanksDisagree(RuntimeError):
    """Ranks were set up differently; the message names each differing item and the ranks."""


def _gather_bytes(backend: Backend, data: bytes, name: str) -> list[bytes]:
    part = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    gathered = backend.wait(backend.allgather_async(wire.pack([part], with_header=True), name))
    return [bytes(p[0].numpy().tobytes()) for p in wire.unpack_gathered(gathered, [part], backend.size(), True, name)]


def verify_ranks_agree(backend: Backend, description: Mapping[str, str], name: str = "consistency") -> None:
    """Raise :class:`RanksDisagree` on every rank if any rank's ``description`` differs."""
    keys = sorted(description)
    digest = torch.tensor([derived_seed(key, description[key]) for key in keys], dtype=torch.int64)
    gathered = backend.wait(backend.allgather_async(digest.reshape(1, -1), f"{name}.digest"))
    if gathered.shape[1] == len(keys) and bool((gathered == gathered[0]).all()):
        return
    texts = _gather_bytes(backend, json.dumps(description, sort_keys=True).encode(), f"{name}.descriptions")
    per_rank = [json.loads(t) for t in texts]
    lines = []
    for key in sorted({k for d in per_rank for k in d}):
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(per_rank):
            groups.setdefault(d.get(key, "<missing>"), []).append(rank)
        if len(groups) > 1:
            variants = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {value}"
                                 for value, r in sorted(groups.items(), key=lambda item: item[1]))
            lines.append(f"  {key}: {variants}")
    raise RanksDisagree("grace_legacy: ranks are set up differently, so their gradients cannot be exchanged "
                        "safely:\n" + "\n".join(lines))
