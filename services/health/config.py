"""Configuration of the health service (only `__main__` reads flags and the environment)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from fthsdp.services.common.parse import MAX_PORT, host_port
from fthsdp.services.health.domain import MAX_BATCH_RECORDS, MAX_NAME_CHARS

FailureAction = Literal["kill", "report"]
FAILURE_ACTIONS: tuple[FailureAction, ...] = ("kill", "report")
Mode = Literal["central", "agent"]
MODES: tuple[Mode, ...] = ("central", "agent")
DEFAULT_PORTS: dict[Mode, tuple[int, int]] = {"central": (7460, 7461), "agent": (7462, 7463)}
"""(gRPC, HTTP) ports per mode, so a central service and an agent can share a host."""
MAX_FORWARD_INTERVAL = timedelta(seconds=30)
"""The longest forward interval central asks of an agent (and an agent accepts)."""


def _check_address(address: str, what: str) -> None:
    try:
        host_port(address)
    except ValueError:
        raise ValueError(f"{what} must be host:port, got {address!r}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class HealthConfig:
    """How one health-service process behaves and where it listens."""

    mode: Mode = "central"
    """`central`: runs the detectors over every node's telemetry, keeps incidents, serves the API
    and the dashboard. `agent`: one per host; watches the local ranks, reports a silent one to the
    quorum service at once, and forwards telemetry and its node state to the central service."""
    host: str = "127.0.0.1"
    """Interface to bind, for gRPC and HTTP; loopback unless told otherwise (DESIGN.md security)."""
    port: int = DEFAULT_PORTS["central"][0]
    """gRPC ingest port; 0 picks a free one."""
    http_port: int | None = DEFAULT_PORTS["central"][1]
    """HTTP port (API, dashboard, /metrics, probes); 0 picks a free one; None serves no HTTP."""
    node: str = "localhost"
    """This host's name (agents name their node with it; incidents carry it)."""
    central: str | None = None
    """Agent: the central service's gRPC `host:port` (None: the agent forwards nothing)."""
    quorum: tuple[str, ...] = ()
    """The quorum service's `host:port` addresses (primary first, standbys after). Agents report
    silent ranks there; the central service evicts per policy and reads the quorum history."""
    redis_url: str | None = None
    """Central: keep incidents and telemetry streams in Redis; None keeps them in memory."""
    redis_prefix: str = "fthsdp:health"
    """Prefix of the Redis keys (several jobs may share one Redis)."""
    heartbeat_timeout: timedelta = timedelta(milliseconds=700)
    """Agent: a local rank not heard from for this long is failed at once. Ranks beat every
    200 ms, so 700 ms tolerates two lost beats (or a 500 ms stall of the sending thread) and
    keeps kill -> new quorum within 1 s."""
    check_interval: timedelta = timedelta(milliseconds=50)
    """Agent: the shortest spacing of the local fail-stop checks. A check runs when the earliest
    rank would fall silent, and at least every quarter of `heartbeat_timeout`."""
    evaluate_interval: timedelta = timedelta(milliseconds=200)
    """Central: how often the detectors are evaluated (as often as new telemetry arrives)."""
    forward_interval: timedelta = timedelta(milliseconds=200)
    """Agent: how often buffered telemetry and the node state go to the central service. The
    ranks send every 200 ms: forwarding more often sends little but node states, at a CPU cost
    that a 2-core host's training pays (100 ms cost the agents and central a third more)."""
    forward_timeout: timedelta = timedelta(seconds=1)
    """Agent: deadline of one forward; a slow central service costs the agent nothing more."""
    ingest_forwards_per_s: float = 500.0
    """Central: the node-state forwards a second it asks its agents for at most. With more
    agents than this many per `forward_interval`, it answers every forward with a longer
    interval (agents / this, at most `MAX_FORWARD_INTERVAL`), and judges fail-stops and hangs
    that much later, since a rank's records may arrive one interval late. One forward costs
    central ~1.6 ms of CPU on a 2-core machine (mostly grpc.aio's per-call work), so 500 a
    second take most of a core; 12,288 agents then forward every ~25 s instead of 0.2 s."""
    quorum_timeout: timedelta = timedelta(seconds=1)
    """Deadline of one report to the quorum service (per address)."""
    max_batch_records: int = 2000
    """Records per forwarded batch (the wire allows up to 10000)."""
    max_buffered_records: int = 100_000
    """Agent: records held for the central service; beyond it the oldest are dropped."""
    max_incidents: int = 10_000
    """Incidents kept (in memory or in the Redis stream)."""
    max_records: int = 100_000
    """Step / collective / fingerprint records kept per kind."""
    shutdown_grace: timedelta = timedelta(seconds=2)
    """On stop, how long in-flight requests may finish before they are cancelled."""
    failure_action: FailureAction = "kill"
    """What a dead or hung rank costs its replica besides the eviction. `kill`: the report asks
    the quorum service for a teardown, so the replica's ranks exit and every node agent kills
    the replica's processes on its host (SIGTERM, SIGKILL after `kill_grace`), by the pids its
    ranks registered; the process manager then restarts it at once. `report`: evicted only, its
    processes are left alone for an operator. Agents and the central service should agree."""
    kill_grace: timedelta = timedelta(seconds=1)
    """Agent: how long a torn-down process may take to exit on SIGTERM before SIGKILL."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.failure_action not in FAILURE_ACTIONS:
            raise ValueError(f"failure_action must be one of {', '.join(FAILURE_ACTIONS)}")
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be in 0..{MAX_PORT}, got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= MAX_PORT:
            raise ValueError(f"http_port must be in 0..{MAX_PORT}, got {self.http_port}")
        if not self.node or len(self.node) > MAX_NAME_CHARS or any(c.isspace() for c in self.node):
            raise ValueError("node must be 1..256 characters without whitespace")
        if self.central is not None:
            _check_address(self.central, "central")
        for address in self.quorum:
            _check_address(address, "each quorum address")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        self._check_durations()
        self._check_bounds()

    def _check_durations(self) -> None:
        for name in (
            "heartbeat_timeout",
            "check_interval",
            "evaluate_interval",
            "forward_interval",
            "forward_timeout",
            "quorum_timeout",
        ):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        if self.check_interval >= self.heartbeat_timeout:
            raise ValueError("check_interval must be shorter than heartbeat_timeout")
        if self.shutdown_grace < timedelta(0) or self.kill_grace < timedelta(0):
            raise ValueError("shutdown_grace and kill_grace must not be negative")

    def _check_bounds(self) -> None:
        if not 1 <= self.max_batch_records <= MAX_BATCH_RECORDS:
            raise ValueError(f"max_batch_records must be in 1..{MAX_BATCH_RECORDS}")
        if self.max_buffered_records < self.max_batch_records:
            raise ValueError("max_buffered_records must be >= max_batch_records")
        if self.max_incidents < 1 or self.max_records < 1:
            raise ValueError("max_incidents and max_records must be >= 1")
        if not self.ingest_forwards_per_s > 0 or self.ingest_forwards_per_s == float("inf"):
            raise ValueError("ingest_forwards_per_s must be a positive number")
