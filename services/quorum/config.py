"""Configuration of the quorum service (only `__main__` reads flags and the environment)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from fthsdp.services.quorum.domain import FAILSLOW_POLICIES

MAX_PORT = 65535


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumConfig:
    """How one quorum service behaves and where it listens."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise (DESIGN.md security)."""
    port: int = 7450
    """gRPC port; 0 picks a free one (the bound address is `QuorumServer.address`)."""
    admin_port: int | None = 7451
    """HTTP port for /metrics, /livez, /readyz; 0 picks a free one; None runs no admin server."""
    min_replicas: int = 1
    """A quorum needs at least this many replicas (besides a majority of the live ones, I6)."""
    join_timeout: timedelta = timedelta(seconds=2)
    """How long a round waits for a live replica that has not asked yet, once a valid quorum is
    waiting. It bounds how long healthy replicas wait on a straggler or a (re)joining replica (I4);
    it never applies while the fast path holds (every member of the previous quorum asked).
    2 s: longer than a normal step skew, far below the collective timeouts it replaces."""
    catchup_timeout: timedelta = timedelta(seconds=60)
    """How long a round waits instead for a replica catching up from its peers once it already
    missed a round that way: its last catch-up (fetch and load) outlasted the join timeout, the
    round went on without it, and it fell behind again. Waiting only the join timeout again
    would leave it catching up forever, each attempt costing the healthy replicas a snapshot
    publish and a join timeout; waiting for it once lets it rejoin. It bounds that one wait (a
    catch-up that slow is a state of tens of GB per rank on a slow link). Soft state: after a
    failover the new leader learns it again from one more missed round."""
    heartbeat_timeout: timedelta = timedelta(seconds=1)
    """A replica not heard from for this long (no heartbeat, no call, not waiting in a round) is
    evicted. 1 s meets the detection target (failure -> new quorum <= 1 s after the last sign of
    life); leaders beat every ~1/4 of it."""
    history_size: int = 128
    """How many recent quorums Status can return."""
    watch_queue_size: int = 1024
    """Events buffered per Watch stream; a subscriber that falls this far behind is dropped and
    must re-subscribe (it gets a fresh snapshot)."""
    shutdown_grace: timedelta = timedelta(seconds=5)
    """On stop, how long in-flight RPCs may finish before they are cancelled."""
    redis_url: str | None = None
    """Durable store and leader election (`redis://[:password@]host:port/db`). None: the
    in-memory store, one instance. Set: membership, incarnations and quorum ids live in Redis,
    and every instance with the same URL and prefix competes for one lease; the others stand by
    (they answer UNAVAILABLE, so clients fail over) and take over when the leader dies."""
    redis_prefix: str = "fthsdp:quorum"
    """Key prefix in Redis: one job (or one control plane) per prefix."""
    lease_ttl: timedelta = timedelta(seconds=1)
    """Leader lease lifetime: a standby takes over at most about this long (plus a tenth of it)
    after the leader dies; the leader renews five times per lease."""
    failslow_policy: str = "off"
    """Fail-slow mitigation (`failslow.FailSlowPlanner`): `off` (every replica trains its even
    share of micro-steps), `rebalance` (move micro-steps from slow replicas to fast ones),
    `evict` (drop the slowest replica when that pays) or `auto` (whichever predicts the most
    micro-steps per second). It needs replicas that train several micro-steps per step."""
    failslow_horizon: timedelta = timedelta(seconds=60)
    """The planner's horizon: an eviction's cost is amortised over it."""
    failslow_evict_cost: timedelta = timedelta(seconds=10)
    """What evicting a replica costs the job (its restart and catch-up, the others' retried
    step): about 8 s for a restart, about 2 s with warm spares."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be in 0..{MAX_PORT}, got {self.port}")
        if self.admin_port is not None and not 0 <= self.admin_port <= MAX_PORT:
            raise ValueError(f"admin_port must be in 0..{MAX_PORT}, got {self.admin_port}")
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        for name in ("join_timeout", "catchup_timeout", "heartbeat_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        if self.shutdown_grace < timedelta(0):
            raise ValueError("shutdown_grace must not be negative")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        if not self.redis_prefix or any(c in self.redis_prefix for c in "{}|"):
            raise ValueError("redis_prefix must be non-empty without '{', '}' or '|'")
        if self.lease_ttl < timedelta(milliseconds=100):
            raise ValueError("lease_ttl must be at least 100 ms")
        if self.failslow_policy not in FAILSLOW_POLICIES:
            raise ValueError(f"failslow_policy must be one of {', '.join(FAILSLOW_POLICIES)}")
        if self.failslow_horizon <= timedelta(0) or self.failslow_evict_cost < timedelta(0):
            raise ValueError("failslow_horizon must be positive, failslow_evict_cost >= 0")
        if self.history_size < 1 or self.watch_queue_size < 1:
            raise ValueError("history_size and watch_queue_size must be >= 1")
