"""`fthsdp up`: the fthsdp control plane alone, as supervised local processes.

It starts `python -m fthsdp.services.quorum`, `python -m fthsdp.services.checkpoint` and
`python -m fthsdp.services.health --mode central`, each its own process with its log under
`RUN_DIR/logs/`, waits until they answer `/readyz`, then writes an env file

    FTHSDP_QUORUM=127.0.0.1:PORT[,127.0.0.1:PORT]    # leader + standby with --redis
    FTHSDP_CHECKPOINT_URL=http://127.0.0.1:PORT
    FTHSDP_SHM_DIR=/dev/shm/fthsdp-up-...             # where ranks on this host publish snapshots
    FTHSDP_HEALTH=127.0.0.1:PORT                       # when the health service ran
    FTHSDP_HEALTH_URL=http://127.0.0.1:PORT
    FTHSDP_TOKEN_FILE=/abs/path/token

so replicas can be started against the stack (`set -a; . RUN_DIR/fthsdp.env; set +a`). The env
file exists exactly while the stack is up; `RUN_DIR/services.json` names every child's pid and
addresses. A child that dies is reported and restarted on the same ports (exponential backoff;
a crash loop stops the stack). SIGINT or SIGTERM stops every child, clients before the store; a
second SIGINT kills what is left at once.

`--redis` adds a local `redis-server` reached only through a unix socket in the run dir (mode
0700, no TCP port), so no password has to travel on a command line, and runs two quorum
instances on it (they elect a leader through a Redis lease; the other stands by); checkpoint and
health use the same Redis.

Security: the token lives in a file (generated, mode 0600, when none is given) and is never
printed; a Redis URL (`--redis-url` may hold a password) reaches the services in their
environment, never on a command line; services bind 127.0.0.1 unless `--host` says otherwise."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from fthsdp.deploy.probe import http_ok
from fthsdp.deploy.processes import (
    GaveUp,
    ManagedProcess,
    RestartPolicy,
    ServiceSpec,
    ServiceSupervisor,
    free_port,
)
from fthsdp.deploy.service_commands import log_flags, redis_env, service_argv
from fthsdp.services.common.tokens import load_token

ENV_FILE_NAME = "fthsdp.env"
STATE_FILE_NAME = "services.json"
TOKEN_FILE_NAME = "token"  # noqa: S105 (a file name, not a secret)
_PROBE_TIMEOUT_S = 0.5
_MAX_UNIX_SOCKET_PATH = 100  # sun_path holds 108 bytes; keep a margin
_SAFE_ENV_VALUE = re.compile(r"^[A-Za-z0-9_./:,@%+=-]*$")


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


def ensure_token_file(config: UpConfig, run_dir: Path) -> tuple[Path, bool]:
    """The token file to use (absolute) and whether it was generated now.

    A given file must hold a valid token. Without one, RUN_DIR/token is reused or created with
    mode 0600 (replicas started against an earlier `up` keep working)."""
    if config.token_file is not None:
        path = config.token_file.resolve()
        load_token(path=str(path))  # raises ValueError/OSError with a clear message
        return path, False
    path = run_dir / TOKEN_FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        load_token(path=str(path))
        return path, False
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    return path, True


def render_env(env: dict[str, str], run_dir: Path) -> str:
    """The env file: `KEY=value` lines that both `set -a; . FILE` and `docker --env-file` read
    (values are quoted only when they must be, since docker keeps quotes literally)."""
    lines = [
        f"# fthsdp up: the control plane of {run_dir}; present while the stack runs.",
        f"# Load it with: set -a; . {shlex.quote(str(run_dir / ENV_FILE_NAME))}; set +a",
    ]
    for key, value in env.items():
        lines.append(f"{key}={value if _SAFE_ENV_VALUE.match(value) else shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


class _Signals:
    """SIGINT/SIGTERM → stop; a second SIGINT → force (kill what is left at once)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.force = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        if self.stop.is_set() and signum == signal.SIGINT:
            self.force = True
        self.stop.set()


def _state(stack: Stack, processes: Sequence[ManagedProcess], env_file: Path) -> str:
    return json.dumps(
        {
            "up_pid": os.getpid(),
            "env_file": str(env_file),
            "services": {
                p.name: {
                    "pid": p.pid,
                    "restarts": p.restarts,
                    "group": p.spec.group or p.name,
                    "addresses": dict(p.spec.addresses),
                    "log": str(p.spec.log_path),
                }
                for p in processes
            },
        },
        indent=2,
    )


def _stack_ready(processes: Sequence[ManagedProcess]) -> bool:
    """Every child live, and in each group (leader + standby) at least one ready."""
    groups: dict[str, list[ServiceSpec]] = {}
    for process in processes:
        groups.setdefault(process.spec.group or process.name, []).append(process.spec)
    return all(
        all(spec.live() for spec in members) and any(spec.ready() for spec in members)
        for members in groups.values()
    )


def _refuse_a_running_stack(state_file: Path) -> None:
    """Two launchers on one run dir would fight over its files: the second one stops here."""
    try:
        pid = int(json.loads(state_file.read_text())["up_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # left behind by a launcher that was killed
    except PermissionError:
        pass
    if pid != os.getpid():
        raise ValueError(f"fthsdp up (pid {pid}) already runs on {state_file.parent}")


def run_up(config: UpConfig, out: TextIO | None = None) -> int:
    """Runs the stack until SIGINT/SIGTERM (0) or a failure to start or a crash loop (1)."""
    stream = out or sys.stdout

    def report(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} fthsdp up: {message}", file=stream, flush=True)

    run_dir = config.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    env_file = (config.env_file or run_dir / ENV_FILE_NAME).resolve()
    state_file = run_dir / STATE_FILE_NAME
    _refuse_a_running_stack(state_file)
    for stale in (env_file, state_file):
        stale.unlink(missing_ok=True)
    token_file, generated = ensure_token_file(config, run_dir)
    if generated:
        report(f"generated a token in {token_file} (mode 0600)")
    stack = plan_stack(config, token_file)
    signals = _Signals()
    signals.install()
    supervisor = ServiceSupervisor(
        stack.services,
        policy=RestartPolicy(max_failures_in_a_row=config.max_restarts),
        report=report,
        on_start=lambda _: _write_atomic(state_file, _state(stack, supervisor.processes, env_file)),
    )
    code = 0
    try:
        supervisor.start_all()
        deadline = time.monotonic() + config.ready_timeout.total_seconds()
        supervisor.wait_ready(lambda: _stack_ready(supervisor.processes), deadline, signals.stop)
        if not signals.stop.is_set():
            _write_atomic(env_file, render_env(stack.env, run_dir))
            report("ready")
            for line in stack.summary:
                print(f"  {line}", file=stream)
            print(f"  env file    {env_file}", file=stream)
            print(_replica_hint(env_file, stack.env), file=stream, flush=True)
            supervisor.supervise(signals.stop)
    except (TimeoutError, RuntimeError, GaveUp) as exc:
        report(f"failed: {exc}")
        code = 1
    finally:
        report("stopping")
        env_file.unlink(missing_ok=True)
        supervisor.stop_all(config.stop_grace.total_seconds(), force=lambda: signals.force)
        signals.restore()
        state_file.unlink(missing_ok=True)
        for path in stack.cleanup:
            shutil.rmtree(path, ignore_errors=True)
        report("stopped")
    return code


def replica_command(env: Mapping[str, str]) -> str:
    """The torchrun command `fthsdp up` suggests for one replica of the demo job, to run in a
    shell that loaded the env file whose variables are `env`: with the health service in the
    stack, its ranks send their telemetry (heartbeats, steps, collectives, digests) to it."""
    parts = [
        "torchrun --standalone --nproc-per-node W -m fthsdp.deploy.demo.train --run-dir runs/job",
        '--replica-id r0 --replica-index 0 --total-replicas R --quorum "$FTHSDP_QUORUM"',
        '--checkpoint-url "$FTHSDP_CHECKPOINT_URL" --shm-dir "$FTHSDP_SHM_DIR"',
    ]
    if "FTHSDP_HEALTH" in env:
        parts.append('--health "$FTHSDP_HEALTH"')
    return " \\\n    ".join(parts)


def _replica_hint(env_file: Path, env: Mapping[str, str]) -> str:
    return (
        "start a replica (W ranks) against it:\n"
        f"  set -a; . {shlex.quote(str(env_file))}; set +a\n"
        + textwrap.indent(replica_command(env), "  ")
    )


# ---------------------------------------------------------------------------------------------
# command line
