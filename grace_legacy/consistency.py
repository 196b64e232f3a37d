"""Catching ranks that disagree, before they exchange a single gradient: each rank describes its
set-up as named items, and every rank raises the same :class:`RanksDisagree` naming each differing
item and which ranks hold which variant (docs/DESIGN.md#ranks-agree)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch

from grace_legacy.core.backend import Backend
from grace_legacy.core.seeds import derived_seed

#: A description: item name -> a text, or a list of entries compared as a set (e.g. parameters).
Description = Mapping[str, str | Sequence[str]]

#: How many differing entries of a list item the message spells out before summarizing.
_SHOWN_ENTRIES = 4


class RanksDisagree(RuntimeError):
    """Ranks were set up differently; the message names each differing item and the ranks."""


def canonical(description: Description) -> str:
    """The description as one text, the same for equal descriptions in every process."""
    return json.dumps({key: value if isinstance(value, str) else list(value) for key, value in description.items()},
                      sort_keys=True)


def description_digest(description: Description) -> int:
    """A 63-bit digest of the whole description (stable across processes, unlike ``hash``)."""
    return derived_seed(canonical(description))


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _entries(entries: Sequence[str]) -> str:
    shown = ", ".join(entries[:_SHOWN_ENTRIES])
    more = len(entries) - _SHOWN_ENTRIES
    return shown + (f" and {more} more" if more > 0 else "")


def _list_variant(value: Sequence[str], reference: Sequence[str], reference_ranks: str) -> str:
    """How a list item differs from the most common variant: the entries added and missing."""
    in_value, in_reference = set(value), set(reference)
    extra = [entry for entry in value if entry not in in_reference]
    missing = [entry for entry in reference if entry not in in_value]
    parts = [f"{len(value)} entries"]
    if extra:
        parts.append(f"has {_entries(extra)} that {reference_ranks} lack")
    if missing:
        parts.append(f"lacks {_entries(missing)}")
    if not extra and not missing:
        parts.append("the same entries in another order")
    return ", ".join(parts)


def describe_differences(per_rank: Sequence[Description], rank_labels: Sequence[int] | None = None) -> list[str]:
    """One line per item on which the ranks' descriptions (``per_rank[i]``: rank ``i``'s) differ,
    naming each rank by ``rank_labels[i]``. A missing item reads ``<missing>``; each item's most common
    variant (the lowest ranks on a tie) comes first, a list item's others as the entries they add and lack."""
    labels = list(range(len(per_rank))) if rank_labels is None else list(rank_labels)
    if len(labels) != len(per_rank):
        raise ValueError(f"rank_labels must name each of the {len(per_rank)} ranks, got {len(labels)} labels")
    lines = []
    for key in sorted({key for description in per_rank for key in description}):
        groups: dict[str, list[int]] = {}
        values: dict[str, str | Sequence[str]] = {}
        for label, description in zip(labels, per_rank, strict=True):
            value = description.get(key, "<missing>")
            text = value if isinstance(value, str) else json.dumps(list(value))
            groups.setdefault(text, []).append(label)
            values[text] = value
        if len(groups) == 1:
            continue
        ordered = sorted(groups, key=lambda text: (-len(groups[text]), labels.index(groups[text][0])))
        reference = values[ordered[0]]
        variants = []
        for text in ordered:
            value = values[text]
            if isinstance(value, str) or isinstance(reference, str):
                shown = value if isinstance(value, str) else f"{len(value)} entries"
            elif text == ordered[0]:
                shown = f"{len(value)} entries"
            else:
                shown = _list_variant(value, reference, _ranks(groups[ordered[0]]))
            variants.append(f"{_ranks(groups[text])}: {shown}")
        lines.append(f"  {key}: " + "; ".join(variants))
    return lines


def _gather_texts(backend: Backend, text: bytes, lengths: Sequence[int], name: str) -> list[str]:
    # Horovod's allgather joins rows of different counts, so each rank sends its own length.
    part = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    gathered = backend.wait(backend.allgather_async(part, name)).numpy().tobytes()
    offsets = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    return [gathered[offsets[i]:offsets[i + 1]].decode() for i in range(len(lengths))]


def verify_ranks_agree(backend: Backend, description: Description, name: str = "consistency",
                       rank_labels: Sequence[int] | None = None) -> None:
    """Raise :class:`RanksDisagree` on every rank if any rank's ``description`` differs. A collective
    (every rank of ``backend``, the same ``name``): one allgather of two numbers per rank when the
    ranks agree, one more of the descriptions when not. ``rank_labels``: see :func:`describe_differences`."""
    text = canonical(description).encode()
    # (digest, length): the same shape on every rank, whatever the description holds.
    mine = torch.tensor([[description_digest(description), len(text)]], dtype=torch.int64)
    gathered = backend.wait(backend.allgather_async(mine, f"{name}.digest"))
    if bool((gathered[:, 0] == gathered[0, 0]).all()):
        return
    texts = _gather_texts(backend, text, gathered[:, 1].tolist(), f"{name}.descriptions")
    lines = describe_differences([json.loads(t) for t in texts], rank_labels)
    raise RanksDisagree("grace_legacy: ranks are set up differently, so their gradients cannot be exchanged "
                        "safely (every rank raises this):\n" + "\n".join(lines))
