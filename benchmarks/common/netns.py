"""A bandwidth-limited cluster on one machine: Linux network namespaces, veth links and ``tc``.

Each worker gets its own network namespace with one interface, :data:`IFACE`, linked by a veth
pair to a port of a bridge that lives in a namespace of its own (the "switch"). Every port is
rate limited in both directions with a token bucket (``tc qdisc ... tbf``): on the worker's
interface for what it sends, on the switch's port for what it receives. That is the model of a
host with a full-duplex NIC of a given rate on a non-blocking switch. The host's own namespace
gets no address on this network, so no traffic leaves the namespaces and nothing outside them
can reach in.

Horovod is launched the way ``horovodrun --gloo`` does it, without ssh: the rendezvous server
(Horovod's own ``RendezvousServer``) runs in the switch namespace, and each worker is started
with ``ip netns exec`` and the environment Horovod's Gloo launcher would give it.
``HOROVOD_GLOO_IFACE`` pins Horovod's global Gloo contexts to :data:`IFACE`, but the contexts it
makes for process sets (the global one included) ignore it and bind to the address of the
machine's hostname, which ``/etc/hosts`` maps to loopback: the workers would then try to reach
each other on 127.0.0.1. So each namespace also gets its own hosts file (``ip netns exec``
bind-mounts ``/etc/netns/NAME/hosts`` over ``/etc/hosts``) mapping the hostname to that
namespace's address. Plain ``torch.distributed`` workers (:class:`TorchJob`) are started the way
``torchrun`` starts one process per host, with their ``TCPStore`` in rank 0's namespace.

    with Cluster(4) as cluster:
        cluster.set_rate(100e6)                         # bits per second; None: unlimited
        job = HorovodJob(cluster, [sys.executable, "train.py"], log_dir)   # or TorchJob
        job.wait(timeout=600)

Needs root (``CAP_NET_ADMIN``) and ``ip``/``tc`` (iproute2). Namespaces are removed on exit,
on error and on Ctrl-C; those left by a run killed outright (SIGKILL) are removed by the next
run, which recognises them by the dead process id in their name.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

IFACE = "bw0"
SUBNET = "10.77.0"
SWITCH_ADDRESS = f"{SUBNET}.254"
PREFIX = "glbw"
# Read by ``ip netns exec NAME`` and bind-mounted over /etc (see ip-netns(8)).
NETNS_ETC = Path("/etc/netns")
_OURS = re.compile(rf"^{PREFIX}(\d+)-")


class NamespaceError(RuntimeError):
    """The machine cannot host the cluster (not root, no iproute2, no veth/bridge/tbf)."""


def _run(argv: Sequence[str]) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if result.returncode != 0:
        raise NamespaceError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def unavailable_reason() -> str | None:
    """Why this machine cannot build the cluster, or ``None`` if it can (checked by trying)."""
    if os.geteuid() != 0:
        return "needs root for network namespaces and tc"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["ip", "-n", probe, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
              "rate", "1mbit", "burst", "16kb", "latency", "50ms"])
    except NamespaceError as error:
        return f"network namespaces are not usable here: {error}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: The signals that wait for a cluster's creation and removal to finish.
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back until the block ends, then delivered to the handlers
    in place before it (the first one received; on the main thread only, where Python runs
    signal handlers).

    Handlers that only take note, rather than a blocked signal mask: a signal that arrived just
    before the block has already been taken by the interpreter, which would run its handler
    (raise ``KeyboardInterrupt``) at some point inside the block anyway; with these handlers in
    place that handler is the one that takes note.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum))
                for signum in DEFERRED_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])


def _namespaces_and_configs(prefix: str) -> list[str]:
    """Names of the namespaces, and of the ``/etc/netns`` configurations, that start with ``prefix``."""
    names = [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]
    configs = [path.name for path in NETNS_ETC.glob(f"{prefix}*")] if NETNS_ETC.is_dir() else []
    return sorted({name for name in names + configs if name.startswith(prefix)})


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of this module whose creating process is gone; return their names."""
    stale = [name for name in _namespaces_and_configs(PREFIX)
             if (match := _OURS.match(name)) and not _alive(int(match.group(1)))]
    for name in stale:
        _delete_namespace(name)
    return stale


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only if no other namespace has a configuration there
    except OSError:
        pass


def tbf_parameters(bits_per_second: float) -> list[str]:
    """Token-bucket settings for one rate.

    The bucket holds 5 ms of traffic (at least 16 KiB) so that a timer tick's worth of packets
    can leave at once at high rates; the queue behind it holds 50 ms (at least 64 KiB) so that a
    TCP flow fills the link instead of losing packets at every burst.
    """
    if not bits_per_second > 0:
        raise ValueError(f"rate must be a positive number of bits per second, got {bits_per_second}")
    bytes_per_second = bits_per_second / 8
    burst = max(16 * 1024, int(bytes_per_second * 0.005))
    limit = burst + max(64 * 1024, int(bytes_per_second * 0.05))
    return ["rate", f"{int(bits_per_second)}bit", "burst", str(burst), "limit", str(limit)]


class Cluster:
    """``workers`` namespaces, one per worker, on a rate-limited bridge. A context manager."""

    def __init__(self, workers: int) -> None:
        if not 1 <= workers <= 250:
            raise ValueError(f"workers must be in [1, 250], got {workers}")
        self.workers = workers
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.rate: float | None = None

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}-w{rank}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def _port(self, rank: int) -> str:
        return f"port{rank}"

    def create(self) -> None:
        """Make the namespaces and their links. Ctrl-C, SIGTERM and SIGHUP wait until they are
        made, then unwind as usual (everything made is removed): a signal that interrupted an
        ``ip`` command could leave that command running on its own (interrupted while being
        started, it is not even waited for), and a namespace it made after :meth:`remove` looked
        would be left behind."""
        remove_stale_namespaces()
        try:
            with _signals_deferred():
                self._make()
        except BaseException:
            self.remove()
            raise

    def _make(self) -> None:
        self._add_namespace(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0"])
        for rank in range(self.workers):
            ns = self.namespace(rank)
            self._add_namespace(ns)
            _run(["ip", "link", "add", IFACE, "netns", ns, "type", "veth",
                  "peer", "name", self._port(rank), "netns", self.switch])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", IFACE])
            _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n"
                                       f"{self.address(rank)} {socket.gethostname()} {ns}\n")
            _run(["ip", "-n", self.switch, "link", "set", self._port(rank), "master", "br0", "up"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def remove(self) -> None:
        """Delete every namespace this cluster made (their interfaces go with them). Idempotent.

        Found by their names' prefix rather than from a list kept while creating, so that a
        namespace made just before an interruption is found too. Ctrl-C, SIGTERM and SIGHUP wait
        until the removal is done, so a second one cannot cut it short.
        """
        with _signals_deferred():
            for name in _namespaces_and_configs(f"{self.prefix}-"):
                _delete_namespace(name)

    def set_rate(self, bits_per_second: float | None) -> None:
        """Limit every link, both directions, to ``bits_per_second`` (``None``: no limit)."""
        for rank in range(self.workers):
            for ns, dev in ((self.namespace(rank), IFACE), (self.switch, self._port(rank))):
                if bits_per_second is None:
                    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                                   capture_output=True)
                else:
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                          *tbf_parameters(bits_per_second)])
        self.rate = bits_per_second

    def command(self, namespace: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]

    def __enter__(self) -> Cluster:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Terminate a process group started with ``start_new_session`` (then kill it)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class _Workers:
    """Worker processes, one per namespace, each in a session of its own, each rank's output in
    ``log_dir/rank{r}.log``; what the jobs below share. Stop them with :meth:`stop` (or use the job
    as a context manager)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []

    def _start(self, cluster: Cluster, rank: int, argv: Sequence[str], env: Mapping[str, str],
               cwd: Path | None) -> None:
        with open(self.log_dir / f"rank{rank}.log", "w") as log:
            self.procs.append(subprocess.Popen(cluster.command(cluster.namespace(rank), list(argv)), stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd,
                                               env=dict(env)))

    def wait(self, timeout: float, poll: Callable[[], None] | None = None, poll_s: float = 0.1) -> None:
        """Wait for every worker, calling ``poll`` meanwhile; on the first failure (or the timeout)
        stop the rest and raise."""
        deadline = time.monotonic() + timeout
        while True:
            if poll is not None:
                poll()
            codes = [proc.poll() for proc in self.procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                self.stop()
                raise RuntimeError(f"worker rank {failed[0]} exited {codes[failed[0]]}\n{self.tail(failed[0])}")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"workers did not finish in {timeout:.0f} s\n{self.tail(0)}")
            time.sleep(poll_s)

    def tail(self, rank: int, chars: int = 6000) -> str:
        path = self.log_dir / f"rank{rank}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs:
            _stop(proc)

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HorovodJob(_Workers):
    """Horovod workers over Gloo, one per namespace of ``cluster``, as ``horovodrun --gloo`` would run them.

    ``argv`` is the worker command (the same for every rank).
    """

    def __init__(self, cluster: Cluster, argv: Sequence[str], log_dir: Path,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.gloo_run import create_slot_env_vars

        super().__init__(log_dir)
        hosts = ",".join(f"{cluster.namespace(rank)}:1" for rank in range(cluster.workers))
        plan = get_host_assignments(parse_hosts(hosts), cluster.workers)
        self.rendezvous = subprocess.Popen(
            cluster.command(cluster.switch, [sys.executable, "-m", "benchmarks.common.netns",
                                             "rendezvous", hosts]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, **(env or {})}, cwd=cwd)
        try:
            port = self.rendezvous.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError(f"the rendezvous server did not start (said {port!r})")
            common = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                      "HOROVOD_GLOO_RENDEZVOUS_ADDR": SWITCH_ADDRESS, "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
                      "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                      "HOROVOD_GLOO_IFACE": IFACE}
            for slot in plan:
                self._start(cluster, slot.rank, argv, {**common, **create_slot_env_vars(slot)}, cwd)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        super().stop()
        if self.rendezvous.poll() is None:
            self.rendezvous.stdin.close()  # the server exits at end of input
            try:
                self.rendezvous.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _stop(self.rendezvous)


class TorchJob(_Workers):
    """Plain ``torch.distributed`` workers, one per namespace of ``cluster``, with the environment
    ``torchrun`` gives each process when every host runs one (``env://`` rendezvous).

    Rank 0's namespace hosts the ``TCPStore`` (``MASTER_ADDR`` is its address on the rate-limited
    network; each namespace has ports of its own, so a fixed port is free), and
    ``GLOO_SOCKET_IFNAME`` binds Gloo's connections to :data:`IFACE`, so every collective crosses
    the limited links.
    """

    def __init__(self, cluster: Cluster, argv: Sequence[str], log_dir: Path,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None, port: int = 29500) -> None:
        super().__init__(log_dir)
        size = str(cluster.workers)
        common = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "MASTER_ADDR": cluster.address(0),
                  "MASTER_PORT": str(port), "WORLD_SIZE": size, "GROUP_WORLD_SIZE": size, "ROLE_WORLD_SIZE": size,
                  "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "ROLE_NAME": "default",
                  "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                  "GLOO_SOCKET_IFNAME": IFACE}
        try:
            for rank in range(cluster.workers):
                self._start(cluster, rank, argv, {**common, "RANK": str(rank), "GROUP_RANK": str(rank),
                                                  "ROLE_RANK": str(rank)}, cwd)
        except BaseException:
            self.stop()
            raise


def serve_rendezvous(hosts: str) -> None:
    """Run Horovod's rendezvous server for ``hosts`` (``name:slots,...``) until stdin closes."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    parsed = parse_hosts(hosts)
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parsed, sum(host.slots for host in parsed)))
    print(port, flush=True)
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "rendezvous":
        serve_rendezvous(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} rendezvous HOST:SLOTS[,...]")
