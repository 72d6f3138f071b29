"""Domain records of the health service: what ranks and node agents report, and what the
detectors conclude. Plain frozen dataclasses (no grpc, fastapi or redis here): the wire layers
convert to and from them, the detectors read them, the stores keep them.

Times are seconds on the reporting host's wall clock (`time.time()`); the service compares them
only with times from the same host or with its own receive time, never across hosts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class RankId:
    """One training rank: rank `rank` (0-based, inside its replica) of replica `replica_id`."""

    replica_id: str
    rank: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Heartbeat:
    """A rank's sign of life with its progress, as the node agent saw it."""

    rank: RankId
    host: str
    """The node agent's host name."""
    step: int
    """The last step this rank committed (-1 before the first)."""
    at: float
    """When the rank sent it."""
    process: str = ""
    """Unique to each start of the rank's process ("" when unknown): a new value means the rank
    restarted, and nothing its previous process had entered is waiting on it any more."""
    pid: int = 0
    """The rank's pid on the agent's host (0: unknown)."""
    pid_start: int = 0
    """That process's start time in clock ticks since boot (0: unknown); with `pid` it names
    the process a teardown may kill (`teardown.ProcessRef`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One committed (or failed) step of one rank, with the workload that explains its time."""

    rank: RankId
    step: int
    started_at: float
    duration_s: float
    """Wall time of the whole step (forward, backward, exchange, optimizer)."""
    tokens: int
    """N: tokens this rank processed in the step, summed over its microbatches."""
    sum_seq_len_sq: int
    """Σ l² over the sequences this rank processed in the step (attention's quadratic term)."""
    committed: bool = True
    exchange_wait_s: float = 0.0
    """Of `duration_s`, the time the rank spent blocked on the cross-replica exchange after its
    own work was done (waiting for the slowest replica). Every healthy replica's wall step
    stretches when one replica is slow, so the fail-slow detector subtracts this to see each
    replica's own time; 0.0 when the worker does not measure it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InboundLink:
    """What a rank received from its ring's left neighbour during one exchange, and how long the
    link took to carry it (the time the rank spent receiving payloads whose header had arrived:
    ~0 on a healthy link, whatever the sender's speed)."""

    sender_replica: str
    bytes: int
    busy_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveRecord:
    """One rank's part in one collective: when it entered and (if it did) left it.

    `group` names the communicator ("ftar:<quorum_id>:<rank>" for the cross-replica ring,
    "replica:<replica_id>" for the intra-replica group); `seq` numbers the collectives of a group in
    the order every member issues them, so the same (group, seq) on two ranks is the same
    collective."""

    rank: RankId
    group: str
    seq: int
    op: str
    """"allreduce", "broadcast", ... (free text for evidence)."""
    started_at: float
    ended_at: float | None = None
    """None while the rank is still inside the collective."""
    inbound: InboundLink | None = None
    """On the exit of a ring exchange: what came in from the left neighbour (the link detector's
    input)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fingerprint:
    """A cheap digest of one replica's parameters at a step (identical across healthy replicas
    by I1, so the odd one out is corrupt)."""

    replica_id: str
    step: int
    digest: str
    quorum_id: int = 0
    """The quorum the step was committed in (0: unknown); see `SdcDetector`."""


class IncidentKind(enum.StrEnum):
    """What went wrong."""

    FAIL_STOP = "fail_stop"
    HANG = "hang"
    SLOW_RANK = "slow_rank"
    FAIL_SLOW = "fail_slow"
    SDC = "sdc"


@dataclass(frozen=True, kw_only=True, slots=True)
class Incident:
    """A detector's conclusion: the culprit and why."""

    kind: IncidentKind
    replica_id: str
    rank: int | None = None
    """The culprit rank inside the replica, when the detector can name one."""
    host: str | None = None
    detected_at: float
    summary: str
    """One human sentence: what and who."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable facts behind the verdict (times, sequence numbers, residuals, digests)."""
