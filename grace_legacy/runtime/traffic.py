"""Byte accounting: ``bytes_sent`` counts the buffers this rank gave the backend (payload, alignment
padding and size headers included); ``bytes_dense`` the gradients' ``numel * element_size``, what an
uncompressed allreduce hands over; ``volume = bytes_sent / bytes_dense``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping
from typing import Any


class _Tally:
    __slots__ = ("sent", "dense", "tensors")

    def __init__(self, sent: int = 0, dense: int = 0, tensors: int = 0) -> None:
        self.sent, self.dense, self.tensors = sent, dense, tensors

    def add(self, sent: int, dense: int) -> None:
        self.sent += sent
        self.dense += dense
        self.tensors += 1

    def as_dict(self) -> dict[str, Any]:
        return {"bytes_sent": self.sent, "bytes_dense": self.dense, "tensors": self.tensors,
                "volume": self.sent / self.dense if self.dense else 0.0}


class TrafficStats:
    """Running totals, optionally broken down by any labels (e.g. LEGACY's group and phase)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._total = _Tally()
        self._routes: Counter[str] = Counter()
        self._breakdowns: dict[str, dict[Hashable, _Tally]] = {}

    def record(self, *, dense_bytes: int, sent_bytes: int, route: str,
               labels: Mapping[str, Hashable] | None = None) -> None:
        self._total.add(sent_bytes, dense_bytes)
        self._routes[route] += 1
        for dimension, key in (labels or {}).items():
            self._breakdowns.setdefault(dimension, {}).setdefault(key, _Tally()).add(sent_bytes, dense_bytes)

    def as_dict(self) -> dict[str, Any]:
        out = self._total.as_dict()
        out["tensors_by_route"] = dict(self._routes)
        for dimension, tallies in self._breakdowns.items():
            out[dimension] = {key: tally.as_dict() for key, tally in sorted(tallies.items(), key=_sort_key)}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "total": (self._total.sent, self._total.dense, self._total.tensors),
            "routes": dict(self._routes),
            "breakdowns": {dim: {key: (t.sent, t.dense, t.tensors) for key, t in tallies.items()}
                           for dim, tallies in self._breakdowns.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._total = _Tally(*state["total"])
        self._routes = Counter(state["routes"])
        self._breakdowns = {dim: {key: _Tally(*values) for key, values in tallies.items()}
                            for dim, tallies in state["breakdowns"].items()}


def _sort_key(item: tuple[Hashable, _Tally]) -> tuple[str, Any]:
    key = item[0]
    return (type(key).__name__, key)
