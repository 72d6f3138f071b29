"""Configuration of a training rank's Manager."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ManagerConfig:
    """Everything a rank needs to take part in fault-tolerant training across replicas.

    Replica ids name the unit of failure: a restarted replica keeps its id and gets a new
    incarnation from the quorum service."""

    job_id: str
    """Names the training job; checkpoints and data positions are stored under it."""
    replica_id: str
    """This replica's stable id (for example `r0`); its members sort into the ring order."""
    replica_index: int
    """This replica's data shard, in `0..total_replicas-1`; fixed for the life of the job."""
    total_replicas: int
    """How many replicas (data shards) the job was configured with; a replica may be down."""
    quorum_address: str
    """`host:port` of the quorum service, or every instance of a leader/standby setup,
    comma-separated (clients fail over among them). Only the replica leader, rank 0, asks for
    quorums."""
    checkpoint_url: str
    """Base URL of this host's checkpoint sidecar (publishes snapshots, writes checkpoints)."""
    token: str
    """Bearer token for the quorum and checkpoint services; never logged."""
    shm_dir: str = "/dev/shm"
    """Shared-memory directory of the checkpoint sidecar (snapshots are copied there)."""
    quorum_timeout: timedelta = timedelta(seconds=60)
    """How long a leader waits for one quorum (covers the service's join timeout and retries)."""
    heartbeat_interval: timedelta = timedelta(milliseconds=200)
    """How often the leader tells the quorum service that its replica is alive."""
    fetch_timeout: timedelta = timedelta(seconds=60)
    """Overall deadline for fetching a healthy peer's state during catch-up."""
    max_failed_commits: int = 8
    """Consecutive failed commits after which the Manager gives up with `TooManyFailedCommits`."""
    durable_every_steps: int = 0
    """A durable checkpoint every K committed steps (0 disables), written by one healthy replica."""
    scale_lr_by_healthy: bool = False
    """Scale each step's learning rate by sqrt(healthy / total_replicas), as the FT-HSDP paper
    recommends when replicas are missing."""
    bucket_bytes: int = 8 << 20
    """Gradients are exchanged in buckets of about this many bytes, each its own FTAR work."""
    exchange_timeout: timedelta = timedelta(seconds=30)
    """Bound on one cross-replica gradient exchange before it counts as failed (recoverable)."""
    overlap_backward: bool = False
    """Exchange each bucket across replicas as soon as backward has produced its gradients, so
    the exchange overlaps the rest of backward (replicated layout only, not FSDP2/DTensor
    params). Needs exactly one backward per step between `start_step` and `finish_step`; the
    first gradient hook of the step waits for the step's quorum."""

    control_plane_grace: timedelta | None = timedelta(milliseconds=300)
    """How long the leader waits for an unreachable quorum service before training the step on
    the previous quorum (only in the steady state; `worker.plan.fallback_payload` says why that
    is safe). None: always wait for the service."""
    health_address: str | None = None
    """`host:port` of this host's health node agent (or the central health service); None sends
    no telemetry. Telemetry never slows or breaks training."""
    fingerprint_every_steps: int = 10
    """Rank 0 sends a digest of the replica's state every K committed steps (0: never), so the
    health service can name a replica that silently diverged."""
    position_record_interval: timedelta | None = timedelta(seconds=1)
    """How often the leader records the committed data positions with the checkpoint sidecar
    (at most; and once more on `shutdown`); None: never. Exactly-once data does not depend on these
    records: the positions are part of the replicated state (they travel with catch-up and with
    durable checkpoints). The records are the job's external trail of progress; recording every
    step would cost an HTTP request and an fsync per step."""

    def __post_init__(self) -> None:
        for name in ("job_id", "replica_id"):
            value = getattr(self, name)
            if not _ID.fullmatch(value):
                raise ValueError(f"{name} must be 1..128 letters, digits, '_', '.' or '-'")
        if self.total_replicas < 1:
            raise ValueError("total_replicas must be >= 1")
        if not 0 <= self.replica_index < self.total_replicas:
            raise ValueError(
                f"replica_index {self.replica_index} outside 0..{self.total_replicas - 1}"
            )
        if self.max_failed_commits < 1:
            raise ValueError("max_failed_commits must be >= 1")
        if self.durable_every_steps < 0:
            raise ValueError("durable_every_steps must be >= 0")
        if self.fingerprint_every_steps < 0:
            raise ValueError("fingerprint_every_steps must be >= 0")
        for name in ("control_plane_grace", "position_record_interval"):
            value = getattr(self, name)
            if value is not None and value < timedelta(0):
                raise ValueError(f"{name} must not be negative")
        if self.bucket_bytes < 1024:
            raise ValueError("bucket_bytes must be >= 1024")
        for name in ("quorum_timeout", "heartbeat_interval", "fetch_timeout", "exchange_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
