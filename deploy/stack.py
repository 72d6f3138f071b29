"""The fthsdp control plane as local processes, for the demo on one machine.

By default the quorum service runs inside this process (on its own event-loop thread, in-memory
store). With `redis=True` it runs as two processes, a leader and a standby, electing through a
local redis-server (the production shape: a killed leader is replaced by the standby, and the
membership survives). The health service runs as a central process plus one node agent per
simulated host. Each checkpoint sidecar is its own process, one per host, so serving state never
competes with the launcher or with training for the interpreter lock.

Where each process runs is a `Placement`: by default every host is this machine's loopback; with
`fthsdp demo --hosts netns` (`deploy.netns_demo`) each host is a network namespace with its own
address, and every service binds and is reached at its host's address."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from fthsdp.deploy.local_redis import LocalRedis
from fthsdp.deploy.probe import http_ok
from fthsdp.deploy.processes import ManagedProcess, ServiceSpec, free_port
from fthsdp.deploy.service_commands import redis_env, service_argv
from fthsdp.services.common.private_dir import ensure_private_dir
from fthsdp.services.common.tokens import load_token
from fthsdp.services.quorum.client import QuorumClient
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.server import QuorumServerThread
from fthsdp.services.quorum.store import InMemoryStore, clock_epoch_floor

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0


def _http_ready(url: str) -> Callable[[], bool]:
    return lambda: http_ok(url, 1.0)[0]


def _wait(check: Callable[[], bool], processes: list[ManagedProcess], what: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not check():
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{process.name} exited; see {process.spec.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {_START_TIMEOUT_S} s")
        time.sleep(0.05)


def _stop(processes: list[ManagedProcess], grace_s: float = 10.0) -> None:
    for process in processes:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        while process.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        process.signal(signal.SIGKILL)
        if process.proc is not None:
            process.proc.wait()


CONTROL = "ctl"
"""The host of the launcher (and of Redis and an embedded quorum service)."""
HEALTH = "hc"
"""The host of the health service's central process."""
QUORUM = ("q0", "q1")
"""The hosts of the quorum leader and standby (with Redis)."""


class Placement:
    """Where the stack's processes run: per host, its address and the argv prefix that starts a
    process there. Hosts: `CONTROL`, `HEALTH`, `QUORUM` and one per replica (named after it).

    `Placement()` puts every host on this machine's loopback. A host without a prefix is the
    launcher's own network namespace."""

    def __init__(
        self,
        addresses: Mapping[str, str] | None = None,
        prefixes: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self._addresses = dict(addresses or {})
        self._prefixes = {host: tuple(p) for host, p in (prefixes or {}).items()}
        self._ports: dict[str, set[int]] = {}

    @property
    def loopback(self) -> bool:
        return not self._addresses

    def address(self, host: str) -> str:
        """The address the host's services bind and its peers connect to."""
        return self._addresses.get(host, "127.0.0.1")

    def prefix(self, host: str) -> list[str]:
        """What runs a command on the host (`ip netns exec <namespace>`; empty: right here)."""
        return list(self._prefixes.get(host, ()))

    def port(self, host: str) -> int:
        """A TCP port free on the host. The launcher cannot bind in another namespace; a fresh
        namespace holds only what the stack starts there, so any number not handed out for the
        host yet will do, and the kernel's ephemeral pick here is such a number."""
        taken = self._ports.setdefault(host, set())
        while True:
            port = free_port(self.address(host) if not self.prefix(host) else "127.0.0.1")
            if port not in taken:
                taken.add(port)
                return port


class Sidecar:
    """One checkpoint sidecar process."""

    def __init__(
        self,
        *,
        name: str,
        run_dir: Path,
        token_file: Path,
        shm_dir: Path,
        durable_dir: Path,
        log_flags: Sequence[str] = (),
        placement: Placement | None = None,
    ) -> None:
        placement = placement or Placement()
        self.name = name
        self.port = placement.port(name)
        host = placement.address(name)
        self.url = f"http://{host}:{self.port}"
        self.shm_dir = shm_dir
        argv = service_argv(
            sys.executable,
            "checkpoint",
            token_file=token_file,
            log_flags=log_flags,
            flags=[
                ("--host", None if placement.loopback else host),
                ("--port", self.port),
                ("--shm-dir", shm_dir),
                ("--durable-dir", durable_dir),
            ],
        )
        self.process = ManagedProcess(
            ServiceSpec(
                name=f"checkpoint-{name}",
                die_with_parent=False,  # this launcher runs gRPC threads: no code before exec
                argv=[*placement.prefix(name), *argv],
                log_path=run_dir / "logs" / f"checkpoint-{name}.log",
                ready=_http_ready(f"{self.url}/readyz"),
            )
        )

    def start(self) -> None:
        ensure_private_dir(self.shm_dir)
        self.process.start()

    def wait_ready(self) -> None:
        _wait(self.process.spec.ready, [self.process], f"checkpoint sidecar {self.name}")


class LocalStack:
    """Quorum service + health service + checkpoint sidecars, started and stopped together."""

    def __init__(
        self,
        *,
        run_dir: Path,
        token_file: Path,
        hosts: list[str],
        checkpoint_dir: Path,
        heartbeat_timeout: timedelta = timedelta(seconds=1),
        join_timeout: timedelta = timedelta(seconds=2),
        min_replicas: int = 1,
        failslow_policy: str = "off",
        shm_root: Path = Path("/dev/shm"),
        redis: bool = False,
        health: bool = True,
        failure_action: str = "kill",
        hang_timeout: timedelta | None = None,
        log_flags: Sequence[str] = (),
        placement: Placement | None = None,
    ) -> None:
        self._run_dir = run_dir
        self.placement = placement or Placement()
        """Where each process runs (default: everything on loopback)."""
        self._log_flags = tuple(log_flags)
        """`--log-format` / `--log-level` given to every service process."""
        self._token_file = token_file
        self._token = load_token(path=str(token_file))
        self._quorum_config = QuorumConfig(
            host=self.placement.address(CONTROL),
            port=0,
            admin_port=0,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            min_replicas=min_replicas,
            failslow_policy=failslow_policy,
        )
        self._embedded: QuorumServerThread | None = None
        self._store_back_at = 0.0
        """Monotonic time before which a dead redis-server is left down (an injected outage)."""
        self.store_up_since = 0.0
        """Monotonic time the redis-server was last restarted by `supervise` (0: never)."""
        self._redis = (
            LocalRedis(
                run_dir / "redis",
                password=secrets.token_hex(16),
                host=self.placement.address(CONTROL),
            )
            if redis
            else None
        )
        self._quorum_processes: list[ManagedProcess] = []
        self._health_processes: list[ManagedProcess] = []
        self._health = health
        self._health_flags: list[tuple[str, object | None]] = [
            ("--on-failure", failure_action),
            ("--hang-timeout-ms", None if hang_timeout is None else _ms(hang_timeout)),
        ]
        self._hosts = hosts
        shm = shm_root / f"fthsdp-{run_dir.resolve().name}-{int(time.time())}"
        self._shm = shm
        self.sidecars = {
            host: Sidecar(
                name=host,
                run_dir=run_dir,
                token_file=token_file,
                shm_dir=shm / host,
                durable_dir=checkpoint_dir,
                log_flags=log_flags,
                placement=self.placement,
            )
            for host in hosts
        }
        self.quorum_address = ""
        """Every quorum service instance, comma-separated (clients fail over among them)."""
        self.health_agents: dict[str, str] = {}
        """Per host: the gRPC address of its health node agent (empty without health)."""
        self.health_url = ""
        """The health service's HTTP API and dashboard (empty without health)."""

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()  # what did start goes, as it would on __exit__
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        if self._redis is not None:
            self._redis.start()
        self.start_quorum()
        # Every process starts before any is waited for: their imports overlap.
        if self._health:
            self._start_health()
        for sidecar in self.sidecars.values():
            sidecar.start()
        if self._health:
            self._wait_health()
        for sidecar in self.sidecars.values():
            sidecar.wait_ready()

    # ---- quorum -------------------------------------------------------------------------------

    def start_quorum(self, port: int | None = None) -> None:
        """Starts the quorum service: embedded (again on the same port after `stop_quorum`), or
        the leader and standby processes with Redis."""
        if self._redis is not None:
            self._start_quorum_processes()
            return
        config = self._quorum_config
        if port is not None:
            config = dataclasses.replace(config, port=port)
        # A fresh in-memory store each start, as after a real restart; its epochs begin above
        # the wall clock so quorum ids never go back (I3).
        store = InMemoryStore(history_size=config.history_size, epoch_floor=clock_epoch_floor())
        self._embedded = QuorumServerThread(config, self._token, store=store)
        self.quorum_address = self._embedded.start()

    def _start_quorum_processes(self) -> None:
        assert self._redis is not None
        config = self._quorum_config
        placement = self.placement
        for name, host in zip(("quorum-a", "quorum-b"), QUORUM, strict=True):
            port, admin = placement.port(host), placement.port(host)
            address = placement.address(host)
            argv = service_argv(
                sys.executable,
                "quorum",
                token_file=self._token_file,
                log_flags=self._log_flags,
                flags=[
                    ("--host", None if placement.loopback else address),
                    ("--port", port),
                    ("--admin-port", admin),
                    ("--min-replicas", config.min_replicas),
                    ("--heartbeat-timeout-ms", _ms(config.heartbeat_timeout)),
                    ("--join-timeout-ms", _ms(config.join_timeout)),
                    ("--failslow-policy", config.failslow_policy),
                ],
            )
            spec = ServiceSpec(
                name=name,
                argv=[*placement.prefix(host), *argv],
                die_with_parent=False,
                env=redis_env("quorum", self._redis.url),
                log_path=self._run_dir / "logs" / f"{name}.log",
                live=_http_ready(f"http://{address}:{admin}/livez"),
                ready=_http_ready(f"http://{address}:{admin}/readyz"),
                addresses={"grpc": f"{address}:{port}", "host": host},
            )
            self._quorum_processes.append(ManagedProcess(spec))
        self._quorum_processes[0].start()  # the first one leads: a deterministic start
        _wait(self._quorum_processes[0].spec.ready, self._quorum_processes, "the quorum leader")
        self._quorum_processes[1].start()
        _wait(self._quorum_processes[1].spec.live, self._quorum_processes, "the quorum standby")
        self.quorum_address = ",".join(p.spec.addresses["grpc"] for p in self._quorum_processes)

    def quorum_leader_host(self) -> str | None:
        """The host of the quorum process that leads now (with Redis), or None."""
        leader = next((p for p in self._quorum_processes if p.spec.ready()), None)
        return None if leader is None else leader.spec.addresses["host"]

    def restart_quorum(self) -> None:
        """The quorum service fails. In-memory: stops and starts fresh on the same port, having
        forgotten every replica (they rejoin by themselves). With Redis: SIGKILLs the leader,
        whose standby takes over with the membership, then restarts it as the new standby."""
        if self._redis is None:
            port = int(self.quorum_address.rsplit(":", 1)[1])
            self.stop_quorum()
            self.start_quorum(port=port)
            return
        leader = next((p for p in self._quorum_processes if p.spec.ready()), None)
        if leader is None:
            log.warning("no quorum leader to kill right now")
            return
        leader.signal(signal.SIGKILL)
        if leader.proc is not None:
            leader.proc.wait()
        leader.start()
        _wait(leader.spec.live, [leader], f"{leader.name} (restarted)")

    # ---- the store ----------------------------------------------------------------------------

    def kill_store(self, down: timedelta) -> None:
        """SIGKILLs the redis-server; `supervise` restarts it once `down` has passed."""
        if self._redis is None:
            raise RuntimeError("no store to kill: the stack runs without Redis")
        self._redis.kill()
        self._store_back_at = time.monotonic() + down.total_seconds()
        log.warning("redis-server killed; back in %.1f s", down.total_seconds())

    def store_down(self) -> bool:
        """Whether the redis-server is down right now (killed, or died and not back yet)."""
        return self._redis is not None and not self._redis.running()

    def supervise(self) -> None:
        """One tick of supervision: a redis-server that died (or was killed and is due) is
        started again on its port, with its append-only file."""
        redis = self._redis
        if redis is None or redis.running() or time.monotonic() < self._store_back_at:
            return
        try:
            redis.start()
        except (RuntimeError, TimeoutError) as exc:
            log.warning("redis-server did not come back: %s", exc)
            self._store_back_at = time.monotonic() + 1.0
            return
        self.store_up_since = time.monotonic()
        log.warning("redis-server restarted")

    def stop_quorum(self) -> None:
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None
        _stop(self._quorum_processes)
        self._quorum_processes.clear()

    def quorum_client(self, *, connect_timeout: timedelta = timedelta(seconds=30)) -> QuorumClient:
        """A client of the quorum service; `connect_timeout` bounds how long a call retries
        while no instance answers as leader."""
        return QuorumClient(self.quorum_address, self._token.value, connect_timeout=connect_timeout)

    def report_failure(self, replica_id: str, reason: str) -> None:
        """Evicts a replica at once (the supervisor saw its process die); without a leader
        right now, its heartbeat timeout evicts it later."""
        client = self.quorum_client(connect_timeout=timedelta(seconds=2))
        try:
            client.report_failure(replica_id, reason, reporter="supervisor")
        except Exception as exc:  # the heartbeat timeout evicts it anyway
            log.warning("report_failure(%s) failed: %s", replica_id, exc)
        finally:
            client.close()

    # ---- health -------------------------------------------------------------------------------

    def _health_spec(
        self, name: str, mode: str, host: str, *extra: tuple[str, object]
    ) -> ServiceSpec:
        placement = self.placement
        address = placement.address(host)
        grpc, http = placement.port(host), placement.port(host)
        argv = service_argv(
            sys.executable,
            "health",
            token_file=self._token_file,
            log_flags=self._log_flags,
            flags=[
                ("--mode", mode),
                ("--host", None if placement.loopback else address),
                ("--port", grpc),
                ("--http-port", http),
                ("--quorum", self.quorum_address),
                *self._health_flags,
                *extra,
            ],
        )
        return ServiceSpec(
            name=name,
            argv=[*placement.prefix(host), *argv],
            die_with_parent=False,
            log_path=self._run_dir / "logs" / f"{name}.log",
            ready=_http_ready(f"http://{address}:{http}/readyz"),
            addresses={"grpc": f"{address}:{grpc}", "http": f"http://{address}:{http}"},
        )

    def _start_health(self) -> None:
        central = self._health_spec("health", "central", HEALTH)
        specs = [central]
        for host in self._hosts:
            agent = self._health_spec(
                f"health-agent-{host}",
                "agent",
                host,
                ("--central", central.addresses["grpc"]),
                ("--node", host),
                # As patient as the quorum service: on a loaded machine a rank's telemetry
                # thread can be starved for half a second without the rank being dead.
                ("--heartbeat-timeout-ms", _ms(self._quorum_config.heartbeat_timeout)),
            )
            specs.append(agent)
            self.health_agents[host] = agent.addresses["grpc"]
        self._health_processes = [ManagedProcess(spec) for spec in specs]
        for process in self._health_processes:
            process.start()
        self.health_url = central.addresses["http"]

    def _wait_health(self) -> None:
        for process in self._health_processes:
            _wait(process.spec.ready, self._health_processes, process.name)

    # ---- everything ---------------------------------------------------------------------------

    def stop(self) -> None:
        # One SIGTERM round for all: each process drains in parallel with the others.
        _stop([sidecar.process for sidecar in self.sidecars.values()] + self._health_processes)
        self.stop_quorum()
        if self._redis is not None:
            self._redis.stop()
        # Snapshots live in RAM; whatever a killed rank left behind goes with the stack.
        shutil.rmtree(self._shm, ignore_errors=True)


def _ms(value: timedelta) -> int:
    return int(value.total_seconds() * 1000)
