"""What `fthsdp up` starts (`up.py` runs it): its `UpConfig`, and the plan made of it — every
child's `ServiceSpec` (argv, environment, log file, probes, ports resolved) and the env file's
variables. Planning starts no process; with `--redis` it writes the local Redis's config file."""

from __future__ import annotations

import hashlib
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from fthsdp.deploy.probe import http_ok
from fthsdp.deploy.processes import ServiceSpec, free_port
from fthsdp.deploy.service_commands import log_flags, redis_env, service_argv

_PROBE_TIMEOUT_S = 0.5
_MAX_UNIX_SOCKET_PATH = 100  # sun_path holds 108 bytes; keep a margin


@dataclass(frozen=True, kw_only=True, slots=True)
class UpConfig:
    """What `fthsdp up` starts and where."""

    run_dir: Path = Path("runs/up")
    """Logs, the generated token, the env file, the state file, durable checkpoints."""
    host: str = "127.0.0.1"
    """Interface every service binds."""
    advertise_host: str | None = None
    """Host written into the env file; default `host`, or this machine's name when `host` is a
    wildcard address."""
    token_file: Path | None = None
    """Bearer token file; default RUN_DIR/token, generated (mode 0600) when missing."""
    quorum_port: int = 0
    """gRPC port of the (first) quorum instance; 0 picks a free port."""
    quorum_admin_port: int = 0
    """HTTP port of its /livez /readyz /metrics; 0 picks a free port."""
    standby_port: int = 0
    """gRPC port of the second quorum instance (with Redis); 0 picks a free port."""
    standby_admin_port: int = 0
    """HTTP port of the second instance's probes and metrics; 0 picks a free port."""
    checkpoint_port: int = 0
    """HTTP port of the checkpoint service; 0 picks a free port."""
    health_port: int = 0
    """gRPC port of the health service; 0 picks a free port."""
    health_http_port: int = 0
    """HTTP port of the health service (probes, dashboard); 0 picks a free port."""
    redis: bool = False
    """Start a local redis-server and run the quorum service as leader + standby on it."""
    redis_url: str | None = None
    """Use this existing Redis instead of starting one (leader + standby as with `redis`)."""
    redis_server: str = "redis-server"
    """The redis-server executable for `redis`."""
    health: bool = True
    """Run the health service (central); False: ranks send no telemetry (`--no-health`)."""
    lease_ttl_ms: int | None = None
    """Leader lease lifetime of the quorum instances (their default when None)."""
    min_replicas: int | None = None
    """Smallest quorum (the quorum service's default when None)."""
    heartbeat_timeout_ms: int | None = None
    """The quorum service evicts a replica silent this long (its default when None)."""
    join_timeout_ms: int | None = None
    """Longest a quorum waits for a live replica that has not asked (its default when None)."""
    catchup_timeout_ms: int | None = None
    """Longest a quorum waits for a replica catching up again after its last catch-up outlasted
    the join timeout (its default when None)."""
    failslow_policy: str | None = None
    """The quorum service's fail-slow mitigation: off, rebalance, evict or auto (its default,
    off, when None)."""
    shm_dir: Path | None = None
    """Where ranks on this host publish snapshots for the checkpoint service; default a fresh
    directory under /dev/shm, removed when the stack stops."""
    durable_dir: Path | None = None
    """Durable checkpoints and data positions; default RUN_DIR/checkpoints."""
    env_file: Path | None = None
    """Where the env file goes; default RUN_DIR/fthsdp.env."""
    ready_timeout: timedelta = timedelta(seconds=60)
    """How long the stack may take to become ready before `up` gives up."""
    stop_grace: timedelta = timedelta(seconds=15)
    """How long each tier of children may take to drain on stop before SIGKILL."""
    max_restarts: int = 10
    """Failures in a row after which a crash-looping service stops the stack; 0: never restart."""
    log_level: str | None = None
    """Passed to every service as --log-level when set."""
    log_format: str | None = None
    """Passed to every service as --log-format when set (text or json)."""
    python: str = sys.executable
    """The interpreter that runs the services."""

    def __post_init__(self) -> None:
        ports = {
            "quorum_port": self.quorum_port,
            "quorum_admin_port": self.quorum_admin_port,
            "standby_port": self.standby_port,
            "standby_admin_port": self.standby_admin_port,
            "checkpoint_port": self.checkpoint_port,
            "health_port": self.health_port,
            "health_http_port": self.health_http_port,
        }
        for name, port in ports.items():
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        fixed = [p for p in ports.values() if p]
        if len(set(fixed)) != len(fixed):
            raise ValueError(f"ports given more than once: {sorted(fixed)}")
        if self.redis and self.redis_url:
            raise ValueError("--redis starts a Redis; --redis-url uses an existing one: not both")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        if self.ready_timeout <= timedelta(0) or self.stop_grace <= timedelta(0):
            raise ValueError("ready_timeout and stop_grace must be positive")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must not be negative")

    @property
    def replicated_quorum(self) -> bool:
        """Whether two quorum instances (leader + standby) share a Redis."""
        return self.redis or self.redis_url is not None


def _wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def free_ports(host: str, count: int, taken: set[int]) -> list[int]:
    """`count` distinct ports the kernel considers free on `host` now, none in `taken`."""
    found: list[int] = []
    while len(found) < count:
        port = free_port(host)
        if port not in taken and port not in found:
            found.append(port)
    return found


@dataclass(kw_only=True, slots=True)
class Stack:
    """The planned children and what the env file says about them."""

    services: list[ServiceSpec]
    env: dict[str, str]
    """The env file's variables, in order."""
    summary: list[str]
    """Lines describing the stack (printed once it is ready)."""
    cleanup: list[Path] = field(default_factory=list)
    """Directories removed when the stack stops."""


def _local(host: str) -> str:
    """Where this machine reaches a service bound to `host` (for probes)."""
    return "127.0.0.1" if _wildcard(host) else host


def _http_probe(url: str) -> Callable[[], bool]:
    return lambda: http_ok(url, _PROBE_TIMEOUT_S)[0]


def _redis_probe(socket_path: Path) -> Callable[[], bool]:
    def ping() -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(_PROBE_TIMEOUT_S)
                sock.connect(str(socket_path))
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return ping


def _redis_socket_path(run_dir: Path) -> tuple[Path, Path | None]:
    """The unix socket of the local Redis and a temporary directory to remove, if one was needed
    because the run dir's path is too long for a socket address."""
    path = run_dir.resolve() / "redis" / "redis.sock"
    if len(str(path)) <= _MAX_UNIX_SOCKET_PATH:
        return path, None
    short = Path(tempfile.mkdtemp(prefix="fthsdp-redis-"))  # mode 0700
    return short / "redis.sock", short


def _redis_spec(config: UpConfig, run_dir: Path) -> tuple[ServiceSpec, str, Path | None]:
    binary = shutil.which(config.redis_server)
    if binary is None:
        raise ValueError(
            f"{config.redis_server!r} not found: scripts/bootstrap.sh installs redis-server, "
            "or pass --redis-server PATH (or --redis-url for an existing Redis)"
        )
    data = run_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)
    sock, temporary = _redis_socket_path(run_dir)
    conf = data / "redis.conf"
    conf.write_text(
        "\n".join(
            [
                "port 0",  # no TCP listener: only the unix socket below
                f"unixsocket {sock}",
                "unixsocketperm 700",
                f"dir {data}",
                "appendonly yes",
                "appendfsync everysec",
                'save ""',
                "protected-mode yes",
                "daemonize no",
                "",
            ]
        )
    )
    spec = ServiceSpec(
        name="redis",
        argv=[binary, str(conf)],
        log_path=run_dir / "logs" / "redis.log",
        live=_redis_probe(sock),
        ready=_redis_probe(sock),
        tier=0,
        addresses={"unix_socket": str(sock)},
    )
    return spec, f"unix://{sock}", temporary


def _quorum_specs(
    config: UpConfig, run_dir: Path, token: Path, ports: dict[str, int], redis_url: str | None
) -> list[ServiceSpec]:
    instances = [("quorum", ports["quorum_port"], ports["quorum_admin_port"])]
    if redis_url is not None:
        instances = [
            ("quorum-a", ports["quorum_port"], ports["quorum_admin_port"]),
            ("quorum-b", ports["standby_port"], ports["standby_admin_port"]),
        ]
    specs = []
    for name, port, admin in instances:
        argv = service_argv(
            config.python,
            "quorum",
            token_file=token,
            log_flags=log_flags(config.log_level, config.log_format),
            flags=[
                ("--host", config.host),
                ("--port", port),
                ("--admin-port", admin),
                ("--min-replicas", config.min_replicas),
                ("--heartbeat-timeout-ms", config.heartbeat_timeout_ms),
                ("--join-timeout-ms", config.join_timeout_ms),
                ("--catchup-timeout-ms", config.catchup_timeout_ms),
                ("--failslow-policy", config.failslow_policy),
                ("--lease-ttl-ms", config.lease_ttl_ms if redis_url is not None else None),
            ],
        )
        base = f"http://{_local(config.host)}:{admin}"
        specs.append(
            ServiceSpec(
                name=name,
                argv=argv,
                env=redis_env("quorum", redis_url),
                log_path=run_dir / "logs" / f"{name}.log",
                live=_http_probe(f"{base}/livez"),
                ready=_http_probe(f"{base}/readyz"),
                group="quorum",
                addresses={"grpc": f"{config.host}:{port}", "admin": f"{base}"},
            )
        )
    return specs


def _checkpoint_spec(
    config: UpConfig,
    run_dir: Path,
    token: Path,
    port: int,
    shm: Path,
    durable: Path,
    redis_url: str | None,
) -> ServiceSpec:
    argv = service_argv(
        config.python,
        "checkpoint",
        token_file=token,
        log_flags=log_flags(config.log_level, config.log_format),
        flags=[
            ("--host", config.host),
            ("--port", port),
            ("--shm-dir", shm),
            ("--durable-dir", durable),
        ],
    )
    base = f"http://{_local(config.host)}:{port}"
    return ServiceSpec(
        name="checkpoint",
        argv=argv,
        env=redis_env("checkpoint", redis_url),
        log_path=run_dir / "logs" / "checkpoint.log",
        live=_http_probe(f"{base}/livez"),
        ready=_http_probe(f"{base}/readyz"),
        addresses={"http": base},
    )


def _health_spec(
    config: UpConfig,
    run_dir: Path,
    token: Path,
    ports: dict[str, int],
    quorum: str,
    redis_url: str | None,
) -> ServiceSpec:
    argv = service_argv(
        config.python,
        "health",
        token_file=token,
        log_flags=log_flags(config.log_level, config.log_format),
        flags=[
            ("--mode", "central"),
            ("--host", config.host),
            ("--port", ports["health_port"]),
            ("--http-port", ports["health_http_port"]),
            ("--quorum", quorum),
            ("--node", socket.gethostname()),
        ],
    )
    base = f"http://{_local(config.host)}:{ports['health_http_port']}"
    return ServiceSpec(
        name="health",
        argv=argv,
        env=redis_env("health", redis_url),
        log_path=run_dir / "logs" / "health.log",
        live=_http_probe(f"{base}/livez"),
        ready=_http_probe(f"{base}/readyz"),
        addresses={"grpc": f"{config.host}:{ports['health_port']}", "http": base},
    )


def _allocate(config: UpConfig, with_standby: bool) -> dict[str, int]:
    wanted = {
        "quorum_port": config.quorum_port,
        "quorum_admin_port": config.quorum_admin_port,
        "checkpoint_port": config.checkpoint_port,
    }
    if with_standby:
        wanted["standby_port"] = config.standby_port
        wanted["standby_admin_port"] = config.standby_admin_port
    if config.health:
        wanted["health_port"] = config.health_port
        wanted["health_http_port"] = config.health_http_port
    missing = [name for name, port in wanted.items() if port == 0]
    taken = {port for port in wanted.values() if port}
    for name, port in zip(missing, free_ports(config.host, len(missing), taken), strict=True):
        wanted[name] = port
    return wanted


def default_shm_dir(run_dir: Path) -> Path:
    """A per-run directory in shared memory (the run dir when /dev/shm is missing)."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    root = Path("/dev/shm")
    return root / f"fthsdp-up-{digest}" if root.is_dir() else run_dir.resolve() / "shm"


def plan_stack(config: UpConfig, token_file: Path) -> Stack:
    """Every child `up` starts, with its ports resolved, and the env file's contents."""
    run_dir = config.run_dir.resolve()
    advertise = config.advertise_host or (
        socket.gethostname() if _wildcard(config.host) else config.host
    )
    services: list[ServiceSpec] = []
    cleanup: list[Path] = []
    summary: list[str] = []
    redis_url = config.redis_url
    if config.redis:
        redis, redis_url, temporary = _redis_spec(config, run_dir)
        services.append(redis)
        cleanup += [temporary] if temporary else []
        summary.append(f"redis       {redis_url} (data in {run_dir / 'redis'})")
    elif redis_url is not None:
        summary.append("redis       an existing Redis (--redis-url)")
    ports = _allocate(config, redis_url is not None)
    quorum = _quorum_specs(config, run_dir, token_file, ports, redis_url)
    services += quorum
    quorum_list = ",".join(
        f"{advertise}:{ports[key]}"
        for key in ("quorum_port", "standby_port")[: len(quorum)]  # leader first
    )
    for spec in quorum:
        summary.append(
            f"{spec.name:<11} {spec.addresses['grpc']}  (admin {spec.addresses['admin']})"
        )
    shm = config.shm_dir or default_shm_dir(run_dir)
    if config.shm_dir is None:
        cleanup.append(shm)
    durable = (config.durable_dir or run_dir / "checkpoints").resolve()
    checkpoint = _checkpoint_spec(
        config,
        run_dir,
        token_file,
        ports["checkpoint_port"],
        shm,
        durable,
        redis_url,
    )
    services.append(checkpoint)
    summary.append(f"checkpoint  {checkpoint.addresses['http']}  (durable {durable})")
    env = {
        "FTHSDP_QUORUM": quorum_list,
        "FTHSDP_CHECKPOINT_URL": f"http://{advertise}:{ports['checkpoint_port']}",
        "FTHSDP_SHM_DIR": str(shm),
    }
    if config.health:
        health = _health_spec(config, run_dir, token_file, ports, quorum_list, redis_url)
        services.append(health)
        env["FTHSDP_HEALTH"] = f"{advertise}:{ports['health_port']}"
        env["FTHSDP_HEALTH_URL"] = f"http://{advertise}:{ports['health_http_port']}"
        summary.append(f"health      {health.addresses['grpc']}  (http {health.addresses['http']})")
    env["FTHSDP_TOKEN_FILE"] = str(token_file)
    return Stack(services=services, env=env, summary=summary, cleanup=cleanup)
