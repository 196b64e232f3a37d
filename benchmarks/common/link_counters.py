"""Counting one step's bytes twice, for the benchmarks that hold link bytes to the byte model: on
the link (the namespace interface's counters) and at grace_legacy's backend (what each collective
needs with bandwidth-optimal algorithms).

*On the link.* The interface counts Ethernet frames: every packet the kernel hands to the veth
device (one TCP segment, or one GSO super-segment of up to 64 KiB) carries one set of headers,
Ethernet 14 + IPv4 20 + TCP 20 bytes and, with TCP timestamps on (Linux's default), a 12-byte
option: :func:`header_bytes`. So ``bytes - packets * header_bytes()`` is exactly the TCP payload
when every packet is a TCP/IPv4 packet with only the timestamp option (pure ACKs count as zero);
the workers' network namespaces carry nothing else once the workers are up (no ARP once the
neighbours are known, no other service), which :func:`read_link`'s idle windows check.

*At the backend.* :class:`CollectiveCounter` wraps a grace_legacy backend class's collectives and
adds, per call on this rank: an allreduce of ``B`` bytes ``2 (P - 1) / P * B``; an allgather the
bytes of the other ranks' parts (read from the gathered result, so parts of different sizes count
as they are); an all-to-all the bytes this rank sends to the others; a broadcast ``(P - 1) / P``
of its bytes. Those are the formulas of :mod:`grace_legacy.runtime.cost`; unlike the bundle's
``stats["wire_bytes"]`` they also see the collectives no gradient is charged for (the per-step
inf/NaN flags, the checks of the ranks' set-ups).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Ethernet, IPv4 and TCP headers of one packet, without TCP options.
BASE_HEADER_BYTES = 14 + 20 + 20
#: The TCP timestamp option (10 bytes, padded to 12) that Linux adds to every segment when on.
TIMESTAMP_OPTION_BYTES = 12


def header_bytes() -> int:
    """Header bytes per packet on this namespace's links (see the module docstring)."""
    try:
        timestamps = Path("/proc/sys/net/ipv4/tcp_timestamps").read_text().strip() != "0"
    except OSError:
        timestamps = True
    return BASE_HEADER_BYTES + (TIMESTAMP_OPTION_BYTES if timestamps else 0)


@dataclass(frozen=True)
class LinkCount:
    """An interface's counters: bytes (Ethernet frames) and packets, sent and received."""

    tx: int
    rx: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: LinkCount) -> LinkCount:
        return LinkCount(self.tx - other.tx, self.rx - other.rx, self.tx_packets - other.tx_packets,
                         self.rx_packets - other.rx_packets)

    def as_dict(self, header: int) -> dict[str, int]:
        """The counts and the TCP payload each way (bytes less ``header`` per packet)."""
        return {"tx": self.tx, "rx": self.rx, "tx_packets": self.tx_packets, "rx_packets": self.rx_packets,
                "tx_payload": self.tx - header * self.tx_packets, "rx_payload": self.rx - header * self.rx_packets}


def read_link(iface: str | None = None) -> LinkCount:
    """This namespace's counters of ``iface`` (default: the cluster's :data:`~benchmarks.common.netns.IFACE`)."""
    if iface is None:
        from benchmarks.common.netns import IFACE

        iface = IFACE
    base = Path("/sys/class/net") / iface / "statistics"
    return LinkCount(*(int((base / name).read_text()) for name in ("tx_bytes", "rx_bytes", "tx_packets",
                                                                   "rx_packets")))


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """What a bandwidth-optimal allreduce of ``nbytes`` puts on each rank's link."""
    return 2 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


class CollectiveCounter:
    """Wraps the collectives of a grace_legacy backend class (``HorovodBackend``,
    ``TorchDistributedBackend``) to count the link bytes they need on this rank (module docstring).
    :attr:`total` is the running count; :meth:`uninstall` puts the class back."""

    def __init__(self) -> None:
        self.total = 0.0
        #: calls so far, by kind (``allreduce``, ``allgather``, ``alltoall``, ``broadcast``)
        self.calls: Counter[str] = Counter()
        self._gathers: dict[Any, int] = {}  # by handle (Horovod's are ints, torch's objects)
        self._saved: dict[str, Any] = {}
        self._backend_class: Any = None

    def _add(self, kind: str, nbytes: float) -> None:
        self.total += nbytes
        self.calls[kind] += 1

    def install(self, backend_class: Any) -> CollectiveCounter:
        counter = self
        allreduce, allgather = backend_class.allreduce_async, backend_class.allgather_async
        alltoall, broadcast, wait = backend_class.alltoall_async, backend_class.broadcast_async, backend_class.wait
        self._saved = {"allreduce_async": allreduce, "allgather_async": allgather, "alltoall_async": alltoall,
                       "broadcast_async": broadcast, "wait": wait}
        self._backend_class = backend_class

        def counted_allreduce(backend: Any, tensor: Any, name: str, average: bool) -> Any:
            counter._add("allreduce", ring_allreduce_bytes(_nbytes(tensor), backend.size()))
            return allreduce(backend, tensor, name, average)

        def counted_allgather(backend: Any, tensor: Any, name: str) -> Any:
            handle = allgather(backend, tensor, name)
            counter._gathers[handle] = _nbytes(tensor)
            return handle

        def counted_alltoall(backend: Any, tensor: Any, splits: list[int], name: str, **options: Any) -> Any:
            row = _nbytes(tensor) // max(tensor.shape[0], 1) if tensor.dim() else tensor.element_size()
            counter._add("alltoall", row * (sum(splits) - splits[backend.rank()]))
            return alltoall(backend, tensor, splits, name, **options)

        def counted_broadcast(backend: Any, tensor: Any, root_rank: int, name: str) -> Any:
            counter._add("broadcast", _nbytes(tensor) * (backend.size() - 1) / backend.size())
            return broadcast(backend, tensor, root_rank, name)

        def counted_wait(backend: Any, handle: Any) -> Any:
            own = counter._gathers.pop(handle, None)
            result = wait(backend, handle)
            if own is not None:
                counter._add("allgather", _nbytes(result) - own)
            return result

        backend_class.allreduce_async, backend_class.allgather_async = counted_allreduce, counted_allgather
        backend_class.alltoall_async, backend_class.broadcast_async = counted_alltoall, counted_broadcast
        backend_class.wait = counted_wait
        return self

    def uninstall(self) -> None:
        for name, method in self._saved.items():
            setattr(self._backend_class, name, method)
        self._saved = {}
