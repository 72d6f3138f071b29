"""Configuration of a training rank's Manager."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from fthsdp.services.common.private_dir import default_shm_dir
from fthsdp.services.common.tokens import load_token
from fthsdp.services.quorum.domain import MAX_MICRO_STEPS

_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
LR_POLICIES = ("none", "sqrt", "linear")
LrPolicy = Literal["none", "sqrt", "linear"]


EXIT_TORN_DOWN = 75
"""Exit status of a rank whose replica was torn down (EX_TEMPFAIL: restart it)."""


def lr_factor(policy: str, healthy: int, total: int) -> float:
    """What the learning rate is multiplied by for a step averaged over `healthy` of `total`
    replicas: 1 with all of them; on a shrink sqrt(healthy / total) (`sqrt`, the FT-HSDP paper's
    recommendation), healthy / total (`linear`), or 1 (`none`)."""
    if policy not in LR_POLICIES:
        raise ValueError(f"lr_policy must be one of {LR_POLICIES}, got {policy!r}")
    if healthy < 1 or total < 1:
        raise ValueError(f"healthy ({healthy}) and total ({total}) replicas must be >= 1")
    ratio = min(healthy, total) / total
    if policy == "sqrt":
        return math.sqrt(ratio)
    if policy == "linear":
        return ratio
    return 1.0


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
    token: str = field(repr=False)
    """Bearer token for the quorum and checkpoint services; never logged (nor in `repr`)."""
    shm_dir: str = field(default_factory=lambda: str(default_shm_dir()))
    """Shared-memory directory of the checkpoint sidecar (snapshots are copied there); the
    sidecar's default is `/dev/shm/fthsdp-<uid>`, private to the user."""
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
    lr_policy: LrPolicy = "none"
    """How `OptimizerWrapper.step` scales the learning rate of a step trained by fewer than
    `total_replicas` replicas (`lr_factor`): `sqrt`, `linear` or `none`. The factor multiplies
    whatever the user's scheduler set for the step and is undone right after the optimizer step,
    so schedulers keep their own arithmetic."""
    micro_steps: int = 1
    """The replica's even share of the global batch per step, in micro-steps: forward and
    backward passes (each over every rank's micro-batch) accumulated into one gradient. The
    quorum service's fail-slow planner (its `--failslow-policy`: off, rebalance, evict or auto)
    may give a slow replica fewer and the fast ones more; `Manager.micro_steps` says how many
    this step has. Rebalancing needs several (e.g. 4); with 1 there is nothing to move. Every
    micro-step's loss should be the mean over its samples, not divided by the micro-steps: the
    Manager divides the exchanged sum by the step's total micro-steps."""
    max_micro_steps: int = 0
    """The most micro-steps the planner may give this replica in one step (0: no limit), e.g.
    where activations are kept across micro-steps."""
    bucket_bytes: int = 8 << 20
    """Gradients are exchanged in buckets of about this many bytes, each its own FTAR work."""
    exchange_timeout: timedelta = timedelta(seconds=30)
    """Bound on one cross-replica gradient exchange before it counts as failed (recoverable)."""
    overlap_backward: bool = False
    """Exchange each bucket across replicas as soon as backward has produced its gradients, so
    the exchange overlaps the rest of backward (replicated layout only, not FSDP2/DTensor
    params). The first gradient hook of the step waits for the step's quorum."""

    control_plane_grace: timedelta | None = timedelta(milliseconds=300)
    """How long the leader waits for an unreachable quorum service before training the step on
    the previous quorum (only in the steady state; `worker.plan.fallback_payload` says why that
    is safe). None: always wait for the service."""
    health_address: str | None = None
    """`host:port` of this host's health node agent (or the central health service); None sends
    no telemetry. Telemetry never slows or breaks training."""
    fingerprint_every_steps: int = 10
    """Rank 0 sends a digest of the replica's state every K committed steps (0: never), so the
    health service can name a replica that silently diverged. It is computed on the training
    thread, over every byte of the rank's state (`state.state_digest`: CRC-32 at memory speed,
    about 0.05 s per GiB here)."""
    position_record_interval: timedelta | None = timedelta(seconds=1)
    """How often the leader records the committed data positions with the checkpoint sidecar
    (at most; and once more on `shutdown`); None: never. Exactly-once data does not depend on these
    records: the positions are part of the replicated state (they travel with catch-up and with
    durable checkpoints). The records are the job's external trail of progress; recording every
    step would cost an HTTP request and an fsync per step."""
    metrics_port: int | None = None
    """Rank 0 serves Prometheus metrics (step time, commits, failed attempts, exchange GB/s,
    catch-ups, quorum wait) on this port (0: any free one); None: no metrics."""
    metrics_host: str = "127.0.0.1"
    """Interface the metrics endpoint binds."""
    await_replicas: timedelta = timedelta(0)
    """How long the leader waits, before the first step, until every one of `total_replicas`
    replicas has registered with the quorum service (the job starts together, as a torchrun
    rendezvous does, rather than on the first replicas up with the others joining some steps in
    as recovering). 0: no wait. A launcher sets it at a job's first launch only: a restarted
    replica joins the running job at once (`fthsdp up` and the demo do so)."""
    exit_on_teardown: bool = True
    """When the quorum service evicts this replica for a teardown (the health service found one
    of its ranks dead or hung), every rank aborts the replica's process group and exits with
    `EXIT_TORN_DOWN`, so the process manager restarts the replica now instead of after a
    collective timeout. False: the eviction is only logged (the script's own watchdog acts)."""

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
        if not 1 <= self.micro_steps <= MAX_MICRO_STEPS:
            raise ValueError(f"micro_steps must be in 1..{MAX_MICRO_STEPS}")
        if not 0 <= self.max_micro_steps <= MAX_MICRO_STEPS:
            raise ValueError(f"max_micro_steps must be in 0..{MAX_MICRO_STEPS}")
        if self.fingerprint_every_steps < 0:
            raise ValueError("fingerprint_every_steps must be >= 0")
        if self.await_replicas < timedelta(0):
            raise ValueError("await_replicas must not be negative")
        for name in ("control_plane_grace", "position_record_interval"):
            value = getattr(self, name)
            if value is not None and value < timedelta(0):
                raise ValueError(f"{name} must not be negative")
        if self.lr_policy not in LR_POLICIES:
            raise ValueError(f"lr_policy must be one of {LR_POLICIES}, got {self.lr_policy!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be in 0..65535")
        if self.bucket_bytes < 1024:
            raise ValueError("bucket_bytes must be >= 1024")
        for name in ("quorum_timeout", "heartbeat_interval", "fetch_timeout", "exchange_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ManagerConfig:
        """The configuration a launcher hands a rank through `FTHSDP_*` variables (what `fthsdp
        up` writes to its env file, plus the replica's identity); keyword arguments win.

        | variable | field |
        |---|---|
        | `FTHSDP_JOB_ID` (default `job`) | job_id |
        | `FTHSDP_REPLICA_ID`, `FTHSDP_REPLICA_INDEX`, `FTHSDP_TOTAL_REPLICAS` | the replica |
        | `FTHSDP_QUORUM`, `FTHSDP_CHECKPOINT_URL`, `FTHSDP_SHM_DIR`, `FTHSDP_HEALTH` | services |
        | `FTHSDP_TOKEN` or `FTHSDP_TOKEN_FILE` | token |
        | `FTHSDP_LR_POLICY`, `FTHSDP_METRICS_PORT`, `FTHSDP_DURABLE_EVERY_STEPS` | as named |
        | `FTHSDP_MICRO_STEPS`, `FTHSDP_MAX_MICRO_STEPS` | as named |
        | `FTHSDP_AWAIT_REPLICAS_S` (seconds) | await_replicas |

        A missing required variable raises ValueError naming it."""
        environ = os.environ if env is None else env
        values: dict[str, Any] = {"job_id": "job"}
        for name, (variable, parse, what) in _ENV_FIELDS.items():
            raw = environ.get(variable)
            if raw:
                try:
                    values[name] = parse(raw)
                except ValueError as exc:
                    raise ValueError(f"{variable}={raw!r} is not a valid {what}") from exc
        values.update(overrides)
        if "token" not in values:
            values["token"] = load_token(env=dict(environ)).value
        required = ("replica_id", "replica_index", "total_replicas", "quorum_address",
                    "checkpoint_url")  # fmt: skip
        missing = [_ENV_FIELDS[name][0] for name in required if name not in values]
        if missing:
            raise ValueError(f"the rank's configuration lacks {', '.join(missing)}")
        return cls(**values)


def _seconds(raw: str) -> timedelta:
    """A duration given in seconds (ValueError unless finite)."""
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number of seconds: {raw!r}")
    return timedelta(seconds=value)


_ENV_FIELDS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "job_id": ("FTHSDP_JOB_ID", str, "string"),
    "replica_id": ("FTHSDP_REPLICA_ID", str, "string"),
    "replica_index": ("FTHSDP_REPLICA_INDEX", int, "integer"),
    "total_replicas": ("FTHSDP_TOTAL_REPLICAS", int, "integer"),
    "quorum_address": ("FTHSDP_QUORUM", str, "string"),
    "checkpoint_url": ("FTHSDP_CHECKPOINT_URL", str, "string"),
    "shm_dir": ("FTHSDP_SHM_DIR", str, "string"),
    "health_address": ("FTHSDP_HEALTH", str, "string"),
    "lr_policy": ("FTHSDP_LR_POLICY", str, "string"),
    "metrics_port": ("FTHSDP_METRICS_PORT", int, "integer"),
    "durable_every_steps": ("FTHSDP_DURABLE_EVERY_STEPS", int, "integer"),
    "micro_steps": ("FTHSDP_MICRO_STEPS", int, "integer"),
    "max_micro_steps": ("FTHSDP_MAX_MICRO_STEPS", int, "integer"),
    "await_replicas": ("FTHSDP_AWAIT_REPLICAS_S", _seconds, "number of seconds"),
}
"""`ManagerConfig.from_env`: field → (variable, parser, what the value must be)."""
