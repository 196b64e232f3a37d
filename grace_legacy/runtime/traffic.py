"""Byte accounting, two ways.

*Handed*: ``bytes_sent`` counts the buffers this rank gave the backend (payload, alignment padding
and size headers included), ``bytes_dense`` the gradients' ``numel * element_size``.

*On the link*: ``wire_bytes`` is what the collectives put on this rank's link with
bandwidth-optimal algorithms (:mod:`grace_legacy.runtime.cost`: an allreduce of ``B`` bytes
``2 (P - 1) / P * B``, an allgather the other ranks' parts, an all-to-all the parts sent to the
others), ``wire_dense`` what a dense ring allreduce of the same gradients would put there.

``volume = wire_bytes / wire_dense``: the share of the link a dense allreduce would use. With one
rank nothing crosses a link, and ``volume`` is the handed ratio ``bytes_sent / bytes_dense``.

:func:`flatten_scalars` turns a ``stats`` dictionary into the flat ``{"grace/volume": ...,
"grace/group/0/volume": ...}`` numbers TensorBoard's ``add_scalar`` or W&B's ``log`` take.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from numbers import Real
from typing import Any


class _Tally:
    __slots__ = ("sent", "dense", "tensors", "wire", "wire_dense")

    def __init__(self, sent: int = 0, dense: int = 0, tensors: int = 0, wire: float = 0.0,
                 wire_dense: float = 0.0) -> None:
        self.sent, self.dense, self.tensors, self.wire, self.wire_dense = sent, dense, tensors, wire, wire_dense

    def add(self, sent: int, dense: int, wire: float, wire_dense: float) -> None:
        self.sent += sent
        self.dense += dense
        self.tensors += 1
        self.wire += wire
        self.wire_dense += wire_dense

    def as_tuple(self) -> tuple:
        return (self.sent, self.dense, self.tensors, self.wire, self.wire_dense)

    def as_dict(self) -> dict[str, Any]:
        if self.wire_dense:
            volume = self.wire / self.wire_dense
        else:
            volume = self.sent / self.dense if self.dense else 0.0
        return {"bytes_sent": self.sent, "bytes_dense": self.dense, "wire_bytes": self.wire,
                "wire_dense": self.wire_dense, "tensors": self.tensors, "volume": volume}


class TrafficStats:
    """Running totals, optionally broken down by any labels (e.g. LEGACY's group and phase)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._total = _Tally()
        self._routes: Counter[str] = Counter()
        self._breakdowns: dict[str, dict[Hashable, _Tally]] = {}

    def record(self, *, dense_bytes: int, sent_bytes: int, route: str, wire_bytes: float = 0.0,
               wire_dense: float = 0.0, labels: Mapping[str, Hashable] | None = None) -> None:
        counts = (sent_bytes, dense_bytes, wire_bytes, wire_dense)
        self._total.add(*counts)
        self._routes[route] += 1
        for dimension, key in (labels or {}).items():
            self._breakdowns.setdefault(dimension, {}).setdefault(key, _Tally()).add(*counts)

    def record_each(self, rows: Sequence[tuple[int, int, float, float]], route: str) -> None:
        """:meth:`record` of each ``(sent_bytes, dense_bytes, wire_bytes, wire_dense)`` in ``rows``, in
        order, all on ``route`` and unlabelled: the same sums, without a call per tensor."""
        add = self._total.add
        for row in rows:
            add(*row)
        self._routes[route] += len(rows)

    def as_dict(self) -> dict[str, Any]:
        out = self._total.as_dict()
        out["tensors_by_route"] = dict(self._routes)
        for dimension, tallies in self._breakdowns.items():
            out[dimension] = {key: tally.as_dict() for key, tally in sorted(tallies.items(), key=_sort_key)}
        return out

    @staticmethod
    def scalars(stats: Mapping[str, Any], prefix: str = "grace") -> dict[str, float]:
        """:func:`flatten_scalars` (what ``Grace.scalars`` calls)."""
        return flatten_scalars(stats, prefix)

    def state_dict(self) -> dict[str, Any]:
        return {
            "total": self._total.as_tuple(),
            "routes": dict(self._routes),
            "breakdowns": {dim: {key: t.as_tuple() for key, t in tallies.items()}
                           for dim, tallies in self._breakdowns.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._total = _Tally(*state["total"])
        self._routes = Counter(state["routes"])
        self._breakdowns = {dim: {key: _Tally(*values) for key, values in tallies.items()}
                            for dim, tallies in state["breakdowns"].items()}


def flatten_scalars(stats: Mapping[str, Any], prefix: str = "grace") -> dict[str, float]:
    """Every number in ``stats`` under its path of keys joined by ``/`` behind ``prefix``, as a float:
    ``{"volume": 0.1, "group": {0: {"volume": 1.0}}}`` gives ``{"grace/volume": 0.1,
    "grace/group/0/volume": 1.0}``. Nested dictionaries are walked in their order; what is not a
    number (lists, strings, ``None``) is left out, so the result only ever holds numbers. With
    ``prefix=""`` the keys start at the first level (``"volume"``)."""
    if not isinstance(prefix, str):
        raise TypeError(f"scalars: prefix must be a string (\"\" for none), got {type(prefix).__name__}")
    if not isinstance(stats, Mapping):
        raise TypeError(f"scalars: stats must be a dictionary, got {type(stats).__name__}")
    flat: dict[str, float] = {}

    def walk(node: Mapping[Any, Any], path: str) -> None:
        for key, value in node.items():
            name = f"{path}/{key}" if path else str(key)
            if isinstance(value, Mapping):
                walk(value, name)
            elif isinstance(value, Real):  # bool, int, float, Fraction, numpy's scalars
                flat[name] = float(value)

    walk(stats, prefix.rstrip("/"))
    return flat


def _sort_key(item: tuple[Hashable, _Tally]) -> tuple[str, Any]:
    key = item[0]
    return (type(key).__name__, key)
