"""Real hosts on one machine, for fault tests: Linux network namespaces on a private bridge.

    with Topology.create(["ctl", "r0", "r1"]) as topo:
        server = topo.popen("ctl", [sys.executable, "-m", "my.server", topo.address("ctl")])
        topo.run("r0", ["python3", "-c", "..."])          # a client on another host
        topo.blackhole("r1")                               # r1's packets vanish; it keeps running
        topo.heal("r1")

Layout. A topology is one *bridge namespace* holding a Linux bridge, and one namespace per host,
joined to the bridge by a veth pair (the host's end inside the host's namespace, the port end in
the bridge namespace) with its own address from a private subnet (10.213.0.0/24 by default) and
loopback up. The bridge has a namespace of its own rather than sitting in the machine's: nothing
is ever made in the machine's namespace (both ends of each veth are created directly where they
live), so no interface, route or address of the machine changes, two topologies (two test
sessions on one machine) can use the same subnet without meeting, and deleting the namespaces
deletes everything. Each host has the whole port space to itself, like a real host.

Neighbours are static: every host knows every other host's MAC address (`nud permanent`), so no
ARP runs. A silent peer then looks as it does across a routed fabric, where packets vanish and a
connect times out, rather than as an ARP failure on a shared segment (an EHOSTUNREACH after ~3 s).

Faults, each checked at start-up (`mechanisms`) and named when missing:
- `blackhole(host)` sets the host's port on the bridge down (mechanism "link down"). Every packet
  to or from the host is dropped silently, its processes and sockets live on, and loopback inside
  it keeps working: a dead switch port. Blackhole routes in the other namespaces were the
  alternative, but a blackhole route fails a local sender at once (connect() gets EINVAL), which is
  a local error, not lost packets.
- `partition(a, b)` cuts a↔b only (mechanism "static neighbours"): each side's neighbour entry for
  the other points at a MAC address no port has, so their frames leave, are flooded by the bridge
  and dropped by every host, in both directions, while both still reach everyone else. Blackhole
  routes to each other's /32 would fail connects with EINVAL (above); `nftables`/`iptables` are not
  installed here and `tc` filters lack their action modules on this kernel.
- `rate_limit(host, mbit)`: a `tbf` qdisc on both ends of the host's veth (its uploads on its end,
  its downloads on the port end).
- `link_flap(host, ...)`: the port down and up on a period, from a thread, until stopped.
- Latency: this kernel has no `netem`, so a userspace delay proxy (`deploy.netns_proxy`) runs in a
  host's namespace (`delay_proxy`) and delays every byte it forwards.

Cleanup: `close()` (the context manager's exit, also after an exception) stops the link flaps,
stops the processes it started, SIGKILLs anything else inside the namespaces and deletes them;
`deploy.netns_cleanup.cleanup_stale` removes what a SIGKILLed maker left (see that module).

Root only: making namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN; `create` says so clearly
(`NetnsUnavailable`) where they are missing."""

from __future__ import annotations

import ipaddress
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

from fthsdp.deploy.netns_checks import SubnetCollision, check_hosts, check_subnet, host_routes
from fthsdp.deploy.netns_cleanup import (
    PREFIX,
    CleanupError,
    CommandFailed,
    NetnsError,
    OwnerRecord,
    check_prefix,
    cleanup_stale,
    command,
    destroy,
    leftovers,
    new_id,
)
from fthsdp.deploy.netns_mechanisms import (
    CI_MECHANISMS,
    MECHANISMS,
    MechanismMissing,
    Mechanisms,
    NetnsUnavailable,
    add_namespace,
    mechanisms,
    require_root,
)

__all__ = [
    "CI_MECHANISMS",
    "DEFAULT_SUBNET",
    "MECHANISMS",
    "PREFIX",
    "CleanupError",
    "CommandFailed",
    "DelayProxyHandle",
    "LinkFlap",
    "MechanismMissing",
    "Mechanisms",
    "NetnsError",
    "NetnsUnavailable",
    "RateLimit",
    "SubnetCollision",
    "Topology",
    "check_subnet",
    "cleanup_stale",
    "leftovers",
    "mechanisms",
    "read_first_line",
]

DEFAULT_SUBNET = "10.213.0.0/24"
"""Private test addresses: inside the topology's namespaces only."""
_BRIDGE_MAC = "02:00:00:02:00:00"
_VOID_MAC = "02:00:00:ff:ff:ff"
"""No port has it: frames sent to it are flooded by the bridge and dropped by every host."""
_PROCESS_GRACE_S = 2.0


# ---- the topology ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A rate limit in force on both ends of a host's link."""

    rate_mbit: float
    """Megabits per second, each direction."""
    burst_bytes: int
    """Bytes that may pass at once after an idle spell (the token bucket's size)."""


@dataclass(frozen=True, slots=True)
class DelayProxyHandle:
    """A delay proxy started by `Topology.delay_proxy`."""

    process: subprocess.Popen[str]
    host: str
    port: int
    """Where it listens, in its host's namespace."""


@dataclass(frozen=True, slots=True)
class _Host:
    name: str
    index: int
    namespace: str
    address: str
    interface: str
    """The veth end inside the host's namespace."""
    port: str
    """The veth end on the bridge."""
    mac: str


class Topology:
    """Hosts on a bridge, each in its own network namespace (see the module's docs).

    Make one with `create`; use it as a context manager, or call `close`."""

    def __init__(
        self, topology_id: str, hosts: Sequence[str], network: ipaddress.IPv4Network
    ) -> None:
        self.id = topology_id
        """`<prefix><6 hex digits>`: the bridge namespace's name, every other name's start."""
        self.subnet = network
        self.bridge_namespace = topology_id
        self.bridge = f"{topology_id}br"
        self._hosts = {
            name: _Host(
                name=name,
                index=i,
                namespace=f"{topology_id}-{name}",
                address=str(network.network_address + i + 1),
                interface=f"{topology_id}e{i}",
                port=f"{topology_id}p{i}",
                mac=f"02:00:00:00:{(i + 1) >> 8:02x}:{(i + 1) & 0xFF:02x}",
            )
            for i, name in enumerate(hosts)
        }
        self._lock = threading.Lock()
        self._link_down: dict[str, set[str]] = {name: set() for name in hosts}
        """Host → why its port is down ("blackhole", "flap"): up when empty."""
        self._partitions: set[frozenset[str]] = set()
        self._rate_limits: dict[str, RateLimit] = {}
        self._flaps: dict[str, LinkFlap] = {}
        self._processes: list[subprocess.Popen[Any]] = []
        self._closed = False

    @classmethod
    def create(
        cls, hosts: Sequence[str], *, prefix: str = PREFIX, subnet: str = DEFAULT_SUBNET
    ) -> Topology:
        """Makes the namespaces, the bridge and the links; everything made so far is removed
        again if a step fails. NetnsUnavailable without root or where namespaces are not
        permitted; SubnetCollision if `subnet` overlaps a route of this machine."""
        names = check_hosts(hosts)
        check_prefix(prefix)
        network = check_subnet(subnet, ())
        if len(names) > network.num_addresses - 2:
            raise ValueError(f"{len(names)} hosts do not fit in {subnet}")
        require_root()
        check_subnet(subnet, host_routes())
        topology = cls(new_id(prefix), names, network)
        OwnerRecord.mine(topology.id, names).write()  # first: a crash from here on is stale
        try:
            topology._build()
        except BaseException:
            topology.close()
            raise
        return topology

    def _build(self) -> None:
        add_namespace(self.bridge_namespace)
        self._batch(self.bridge_namespace, [
            f"link add {self.bridge} type bridge stp_state 0 forward_delay 0",
            f"link set {self.bridge} address {_BRIDGE_MAC}",
            f"link set {self.bridge} up",
        ])  # fmt: skip
        for host in self._hosts.values():
            add_namespace(host.namespace)
            command([
                "ip", "link", "add", host.port, "netns", self.bridge_namespace,
                "type", "veth", "peer", "name", host.interface, "netns", host.namespace,
                "address", host.mac,
            ])  # fmt: skip
            neighbours = [
                f"neigh replace {peer.address} lladdr {peer.mac} dev {host.interface} nud permanent"
                for peer in self._hosts.values()
                if peer is not host
            ]
            self._batch(host.namespace, [
                "link set lo up",
                f"addr add {host.address}/{self.subnet.prefixlen} dev {host.interface}",
                f"link set {host.interface} up",
                *neighbours,
            ])  # fmt: skip
        self._batch(
            self.bridge_namespace,
            [f"link set {h.port} master {self.bridge} up" for h in self._hosts.values()],
        )

    @staticmethod
    def _batch(namespace: str, lines: Sequence[str]) -> None:
        command(["ip", "-n", namespace, "-batch", "-"], stdin="\n".join(lines) + "\n")

    @staticmethod
    def mechanisms() -> Mechanisms:
        """Which mechanisms work here (probed once per process; see `mechanisms`)."""
        return mechanisms()

    # ---- names and addresses ----------------------------------------------------------------

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(self._hosts)

    def _host(self, host: str) -> _Host:
        try:
            return self._hosts[host]
        except KeyError:
            raise ValueError(f"no host {host!r} in this topology: {self.hosts}") from None

    def address(self, host: str) -> str:
        """The host's IPv4 address (reachable from every other host)."""
        return self._host(host).address

    def namespace(self, host: str) -> str:
        """The name of the host's network namespace (`ip netns exec <it> ...`)."""
        return self._host(host).namespace

    def interface(self, host: str) -> str:
        """The host's end of its link, inside its namespace."""
        return self._host(host).interface

    def port(self, host: str) -> str:
        """The bridge's end of the host's link, inside `bridge_namespace`."""
        return self._host(host).port

    def namespaces(self) -> list[str]:
        """Every namespace of the topology, the bridge's last."""
        return [h.namespace for h in self._hosts.values()] + [self.bridge_namespace]

    # ---- processes --------------------------------------------------------------------------

    def exec_prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command inside the host's namespace."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Starts `argv` inside the host's namespace (Popen keyword arguments as given); it is
        stopped at `close` if still running."""
        self._check_open()
        proc: subprocess.Popen[Any] = subprocess.Popen([*self.exec_prefix(host), *argv], **kwargs)
        self._processes.append(proc)
        return proc

    def run(
        self,
        host: str,
        argv: Sequence[str],
        *,
        timeout: float = 30.0,
        check: bool = True,
        stdin: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs `argv` inside the host's namespace to its end; its output as text.
        CommandFailed if `check` and it exits non-zero."""
        self._check_open()
        argv = [*self.exec_prefix(host), *argv]
        result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise CommandFailed(argv, result.returncode, result.stderr)
        return result

    def delay_proxy(
        self,
        host: str,
        *,
        target: tuple[str, int],
        delay: timedelta,
        port: int = 0,
        ready_timeout: timedelta = timedelta(seconds=15),
    ) -> DelayProxyHandle:
        """Starts `deploy.netns_proxy` in the host's namespace, listening on the host's address
        (`port`, 0: any free one) and forwarding to `target`, each byte `delay` later each way."""
        argv = [
            sys.executable, "-m", "fthsdp.deploy.netns_proxy",
            "--listen", f"{self.address(host)}:{port}",
            "--target", f"{target[0]}:{target[1]}",
            "--delay-ms", str(int(delay.total_seconds() * 1000)),
        ]  # fmt: skip
        proc = self.popen(host, argv, stdout=subprocess.PIPE, text=True)
        line = read_first_line(proc, ready_timeout)
        bound = int(line.rsplit(":", 1)[1])
        return DelayProxyHandle(process=proc, host=host, port=bound)

    # ---- faults -----------------------------------------------------------------------------

    def blackhole(self, host: str) -> None:
        """Drops every packet to and from `host` (its port on the bridge goes down); its
        processes keep running and its loopback keeps working."""
        self._set_link_reason(host, "blackhole", down=True)

    def heal(self, host: str) -> None:
        """Ends `blackhole(host)` (the port stays down while a link flap has it down)."""
        self._set_link_reason(host, "blackhole", down=False)

    def blackholed(self, host: str) -> bool:
        return "blackhole" in self._link_down[self._host(host).name]

    def partition(self, a: str, b: str) -> None:
        """Drops every packet between `a` and `b` only, both ways; each still reaches the rest."""
        self._partition(a, b, cut=True)

    def heal_partition(self, a: str, b: str) -> None:
        """Ends `partition(a, b)`."""
        self._partition(a, b, cut=False)

    def _partition(self, a: str, b: str, *, cut: bool) -> None:
        self._check_open()
        first, second = self._host(a), self._host(b)
        if first is second:
            raise ValueError(f"a host cannot be partitioned from itself: {a!r}")
        mechanisms().require("static neighbours")
        for near, far in ((first, second), (second, first)):
            mac = _VOID_MAC if cut else far.mac
            self._batch(
                near.namespace,
                [f"neigh replace {far.address} lladdr {mac} dev {near.interface} nud permanent"],
            )
        pair = frozenset((a, b))
        if cut:
            self._partitions.add(pair)
        else:
            self._partitions.discard(pair)

    def partitioned(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._partitions

    def rate_limit(self, host: str, rate_mbit: float) -> RateLimit:
        """Limits the host's traffic to `rate_mbit` each way (a `tbf` qdisc on both ends of its
        link, replacing any earlier limit)."""
        self._check_open()
        if not 0 < rate_mbit <= 100_000:
            raise ValueError(f"rate_mbit must be in (0, 100000], got {rate_mbit}")
        mechanisms().require("tbf")
        target = self._host(host)
        rate_bits = int(rate_mbit * 1_000_000)
        # 20 ms worth of tokens, at least one full-sized (64 KiB) GSO packet.
        burst = max(rate_bits // 8 // 50, 64 * 1024)
        limit = RateLimit(rate_mbit=rate_mbit, burst_bytes=burst)
        qdisc = ["root", "tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "100ms"]
        command(["tc", "-n", target.namespace, "qdisc", "replace", "dev", target.interface, *qdisc])
        command(["tc", "-n", self.bridge_namespace, "qdisc", "replace", "dev", target.port, *qdisc])
        self._rate_limits[host] = limit
        return limit

    def clear_rate_limit(self, host: str) -> None:
        """Removes `rate_limit(host)`'s qdiscs (a no-op without one)."""
        self._check_open()
        target = self._host(host)
        if self._rate_limits.pop(host, None) is None:
            return
        command(["tc", "-n", target.namespace, "qdisc", "del", "dev", target.interface, "root"])
        command(["tc", "-n", self.bridge_namespace, "qdisc", "del", "dev", target.port, "root"])

    def rate_limits(self) -> dict[str, RateLimit]:
        """The limits in force, by host."""
        return dict(self._rate_limits)

    def link_flap(
        self,
        host: str,
        *,
        period: timedelta,
        duration: timedelta | None = None,
        down_fraction: float = 0.5,
    ) -> LinkFlap:
        """Starts taking the host's link down for `down_fraction` of every `period`, for
        `duration` (None: until stopped); returns the running flap (`stop()` it, or use it as a
        context manager). One flap per host at a time."""
        self._check_open()
        self._host(host)
        mechanisms().require("link down")
        current = self._flaps.get(host)
        if current is not None and current.active:
            raise ValueError(f"{host} already flaps")
        flap = LinkFlap(self, host, period=period, duration=duration, down_fraction=down_fraction)
        self._flaps[host] = flap
        flap.start()
        return flap

    def _set_link_reason(self, host: str, reason: str, *, down: bool) -> None:
        self._check_open()
        target = self._host(host)
        mechanisms().require("link down")
        with self._lock:
            reasons = self._link_down[host]
            was_down = bool(reasons)
            if down:
                reasons.add(reason)
            else:
                reasons.discard(reason)
            if bool(reasons) != was_down:
                state = "down" if reasons else "up"
                command(["ip", "-n", self.bridge_namespace, "link", "set", target.port, state])

    # ---- the end ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise NetnsError(f"topology {self.id} is closed")

    def close(self) -> None:
        """Removes everything: stops link flaps and the processes started here, kills anything
        else inside the namespaces, deletes the namespaces (and so every link). Idempotent;
        CleanupError if something could not be removed."""
        if self._closed:
            return
        errors: list[str] = []
        for flap in list(self._flaps.values()):
            try:
                flap.stop()
            except Exception as exc:
                errors.append(f"link flap of {flap.host}: {exc}")
        self._closed = True
        self._stop_processes()
        try:
            destroy(self.id, self.namespaces())
        except CleanupError as exc:
            errors.append(str(exc))
        if errors:
            raise CleanupError("; ".join(errors))

    def _stop_processes(self) -> None:
        running = [p for p in self._processes if p.poll() is None]
        for proc in running:
            proc.terminate()
        deadline = time.monotonic() + _PROCESS_GRACE_S
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in self._processes:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()

    def __enter__(self) -> Topology:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LinkFlap:
    """Takes a host's link down and up on a period, from a thread (`Topology.link_flap`).

    Shares the port with `blackhole`: the link is up only when neither holds it down, so stopping
    a flap leaves a blackholed host dark and a healthy one up."""

    def __init__(
        self,
        topology: Topology,
        host: str,
        *,
        period: timedelta,
        duration: timedelta | None,
        down_fraction: float,
    ) -> None:
        if period <= timedelta(0) or (duration is not None and duration <= timedelta(0)):
            raise ValueError("period and duration must be positive")
        if not 0 < down_fraction < 1:
            raise ValueError(f"down_fraction must be in (0, 1), got {down_fraction}")
        self.host = host
        self._topology = topology
        self._down_s = period.total_seconds() * down_fraction
        self._up_s = period.total_seconds() - self._down_s
        self._duration_s = None if duration is None else duration.total_seconds()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.cycles = 0
        """Completed down-and-up cycles."""
        self._thread = threading.Thread(target=self._run, name=f"link-flap-{host}", daemon=True)

    @property
    def active(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for a flap with a duration to end by itself; whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Ends the flap and restores the link (idempotent); re-raises an error of the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise NetnsError(f"link flap of {self.host} failed: {error}") from error

    def _run(self) -> None:
        end = None if self._duration_s is None else time.monotonic() + self._duration_s
        set_link = self._topology._set_link_reason
        try:
            while end is None or time.monotonic() < end:
                set_link(self.host, "flap", down=True)
                stopped = self._stop.wait(self._down_s)
                set_link(self.host, "flap", down=False)
                if stopped or self._stop.wait(self._up_s):
                    return
                self.cycles += 1
        except BaseException as exc:
            self._error = exc
        finally:
            try:
                set_link(self.host, "flap", down=False)
            except NetnsError as exc:
                self._error = self._error or exc

    def __enter__(self) -> LinkFlap:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def read_first_line(proc: subprocess.Popen[str], timeout: timedelta) -> str:
    """The first line `proc` writes to its stdout (a text pipe), stripped, waiting at most
    `timeout`; NetnsError if it exits or stays silent meanwhile."""
    assert proc.stdout is not None, "start the process with stdout=subprocess.PIPE, text=True"
    what = " ".join(map(str, proc.args)) if isinstance(proc.args, list) else str(proc.args)
    deadline = time.monotonic() + timeout.total_seconds()
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while not selector.select(timeout=0.05):
            if proc.poll() is not None:
                raise NetnsError(f"{what} exited with {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise NetnsError(f"{what} not ready after {timeout.total_seconds()} s")
    line = proc.stdout.readline()
    if not line:
        raise NetnsError(f"{what} closed its output before it was ready")
    return line.strip()
