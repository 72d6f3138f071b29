"""`fthsdp demo --hosts netns`: the demo's hosts as network namespaces (`deploy.netns`).

Hosts: `ctl` (the launcher itself, Redis, an embedded quorum service), `hc` (the health
service's central process), `q0` and `q1` (the quorum leader and standby, with Redis) and one
per replica (its ranks, its checkpoint sidecar, its health node agent), each with its own
address on a private bridge. The launcher moves itself into `ctl` before it starts any thread:
every thread and child it starts from then on lives there too and reaches every host through
the bridge, as a launcher on a real control host would; nothing it starts binds the machine's
own loopback. On the way out it moves back and removes every namespace, also after Ctrl-C or
an exception (a launcher killed with SIGKILL leaves them to `netns.cleanup_stale`).

Faults (the demo's `--kill-mode`), each healed after `--fault-for` seconds:
- `blackhole`: a replica's host drops every packet; its processes live on;
- `leader-blackhole`: the quorum leader's host (with Redis) drops every packet; how long a
  client connected to it takes to be answered by the standby goes to `netns_faults.jsonl` in
  the run directory;
- `leader-redis-cut`: the quorum leader's host and `ctl` (Redis, the launcher) cannot reach
  each other; the replicas still reach both quorum instances;
- `health-cut`: a replica's host and health central cannot reach each other; everything else
  (the quorum service above all) still can;
- `flap`: a replica's link goes down and up every `FLAP_PERIOD` (half of it down);
- `slow-link`: a replica's link is rate-limited to `SLOW_LINK_MBIT` each way (`tbf`)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from fthsdp.deploy.netns import LinkFlap, NetnsUnavailable, Topology
from fthsdp.deploy.netns_mechanisms import require_root
from fthsdp.deploy.stack import CONTROL, HEALTH, QUORUM, LocalStack, Placement

log = logging.getLogger(__name__)

HOSTS = ("loopback", "netns")
"""Where the demo's hosts are: all on this machine's loopback, or each in its own network
namespace (root only)."""
NETNS_KILL_MODES = (
    "blackhole",
    "leader-blackhole",
    "leader-redis-cut",
    "health-cut",
    "flap",
    "slow-link",
)
"""The demo's faults that need `--hosts netns` (see the module's docs)."""
FLAP_PERIOD = timedelta(seconds=3)
"""`flap`: one down-and-up cycle of the link."""
SLOW_LINK_MBIT = 40.0
"""`slow-link`: a few times slower than the demo's exchange needs at full speed (~0.5 MB of
gradients per step and rank), far from a dead link."""
_CLONE_NEWNET = 0x40000000


_PARTITIONS = {"health-cut": HEALTH, "leader-redis-cut": CONTROL}
"""Partition faults: the host on the other side of the cut."""


def _setns(fd: int) -> None:
    """Moves the calling thread into the network namespace open as `fd`."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault in force: what, on which hosts, and when it is healed (monotonic seconds)."""

    mode: str
    hosts: tuple[str, ...]
    heal_at: float


class NetnsHosts:
    """The topology of one demo run, entered as a context manager from the launcher's main
    thread before it starts any other thread; yields the `Placement` of the stack."""

    def __init__(self, replica_ids: Sequence[str], *, redis: bool) -> None:
        self.hosts = [CONTROL, HEALTH, *(QUORUM if redis else ()), *replica_ids]
        self.topology: Topology | None = None
        self._home: int | None = None
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._probes: list[threading.Thread] = []
        self._flaps: dict[str, LinkFlap] = {}

    def __enter__(self) -> Placement:
        try:
            require_root()  # the user's error first, whatever else is wrong
        except NetnsUnavailable as exc:
            raise ValueError(f"--hosts netns: {exc}") from exc
        if threading.active_count() != 1:
            raise RuntimeError("enter the namespaces before any thread starts")
        try:
            topology = Topology.create(self.hosts)
        except NetnsUnavailable as exc:  # a user error: asked for namespaces without root
            raise ValueError(f"--hosts netns: {exc}") from exc
        self.topology = topology
        try:
            self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            target = os.open(f"/var/run/netns/{topology.namespace(CONTROL)}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
        except BaseException:
            self._close()
            raise
        log.info("hosts in network namespaces (topology %s)", topology.id)
        return Placement(
            addresses={host: topology.address(host) for host in self.hosts},
            prefixes={host: topology.exec_prefix(host) for host in self.hosts if host != CONTROL},
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()

    def _close(self) -> None:
        # Home first: the topology's removal kills every process inside its namespaces.
        if self._home is not None:
            _setns(self._home)
            os.close(self._home)
            self._home = None
        if self.topology is not None:
            self.topology.close()

    # ---- faults -------------------------------------------------------------------------------

    def _topology(self) -> Topology:
        if self.topology is None:
            raise RuntimeError("the topology is not up")
        return self.topology

    def inject(self, mode: str, hosts: Sequence[str], period_s: float) -> None:
        """Starts fault `mode` (one of `NETNS_KILL_MODES`) on `hosts`; `heal_due` ends it
        `period_s` later."""
        topology = self._topology()
        (host,) = hosts
        if mode in ("blackhole", "leader-blackhole"):
            topology.blackhole(host)
        elif mode in _PARTITIONS:
            topology.partition(host, _PARTITIONS[mode])
        elif mode == "slow-link":
            topology.rate_limit(host, SLOW_LINK_MBIT)
        elif mode == "flap":
            flap = topology.link_flap(
                host, period=FLAP_PERIOD, duration=timedelta(seconds=period_s)
            )
            self._flaps[host] = flap
        else:
            raise ValueError(f"unknown netns fault {mode!r}; one of {NETNS_KILL_MODES}")
        with self._lock:
            self._faults.append(Fault(mode, tuple(hosts), time.monotonic() + period_s))
        log.warning("netns fault %s on %s for %.1f s", mode, ",".join(hosts), period_s)

    def inject_leader_blackhole(
        self, host: str, period_s: float, stack: LocalStack, run_dir: Path
    ) -> None:
        """Blackholes the quorum leader's host, and times from a thread how long a client that
        was talking to it takes to get an answer (from the standby, necessarily)."""
        client = stack.quorum_client(connect_timeout=timedelta(seconds=30))
        try:
            client.status()  # connected to the leader, as every replica's client is
        except Exception:
            client.close()
            raise
        self.inject("leader-blackhole", [host], period_s)
        start = time.monotonic()

        def probe() -> None:
            record: dict[str, object] = {"mode": "leader-blackhole", "host": host}
            try:
                client.status()
                record["failover_s"] = round(time.monotonic() - start, 3)
            except Exception as exc:
                record["error"] = str(exc)
            finally:
                client.close()
            log.warning("quorum client failover after a blackholed leader: %s", record)
            with (run_dir / "netns_faults.jsonl").open("a") as out:
                out.write(json.dumps(record) + "\n")

        thread = threading.Thread(target=probe, name="netns-failover-probe", daemon=True)
        thread.start()
        self._probes.append(thread)

    def join_probes(self, timeout_s: float = 40.0) -> None:
        """Waits for the failover probes still running (each ends within its client's
        connect timeout)."""
        for thread in self._probes:
            thread.join(timeout_s)

    @property
    def faulty(self) -> set[str]:
        """Hosts under a fault now."""
        with self._lock:
            return {host for fault in self._faults for host in fault.hosts}

    def heal_due(self, now: float | None = None, *, everything: bool = False) -> list[Fault]:
        """Heals the faults whose period ended (all of them with `everything`); returns them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [f for f in self._faults if everything or f.heal_at <= now]
            self._faults = [f for f in self._faults if f not in due]
        topology = self._topology()
        for fault in due:
            host = fault.hosts[0]
            if fault.mode in _PARTITIONS:
                topology.heal_partition(host, _PARTITIONS[fault.mode])
            elif fault.mode == "flap":
                self._flaps.pop(host).stop()
            elif fault.mode == "slow-link":
                topology.clear_rate_limit(host)
            else:
                topology.heal(host)
            log.warning("netns fault %s on %s healed", fault.mode, ",".join(fault.hosts))
        return due
