"""The quorum service's domain objects and errors, shared by the server, the core and the clients.

One definition for all of them: the worker may import a service's client modules and its `domain`
(DESIGN.md import rules, enforced by tests/unit/test_import_rules.py), never its server or core."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Literal, TypeVar

import grpc

from fthsdp.services.common import errors as common_errors

EventKind = Literal["snapshot", "joined", "left", "evicted", "quorum"]

MAX_WATCHED_REPLICAS = 256
"""Replica ids one Watch stream may be filtered to (a node agent's: its host's replicas)."""

_T = TypeVar("_T")

_EMPTY_SOURCES: Mapping[str, tuple[tuple[str, ...], ...]] = MappingProxyType({})


def _no_sources() -> Mapping[str, tuple[tuple[str, ...], ...]]:
    return _EMPTY_SOURCES


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEndpoint:
    """Where one rank of a replica can be reached."""

    ftar: str
    """FTAR data-plane address of the rank, `host:port`."""
    checkpoint: str
    """Base URL of the rank's checkpoint service, `http://host:port`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Member:
    """One replica of a quorum."""

    replica_id: str
    """Stable name of the replica."""
    incarnation: int
    """Which process start of the replica this is (grows on every Join)."""
    step: int
    """The step the replica asked a quorum for."""
    ranks: tuple[RankEndpoint, ...]
    """Per-rank endpoints, in rank order. In a quorum as a caller received it, only the members
    it needs have them (`Quorum.needed_by`); the others' are empty."""


FAILSLOW_POLICIES = ("off", "rebalance", "evict", "auto")
"""The quorum service's fail-slow mitigation policies (`QuorumConfig.failslow_policy`)."""

SOURCES_PER_RANK = 4
"""Healthy replicas a recovering rank fetches its state from, striped across them (each also the
others' fallback): enough to spread the load and survive a source's death mid-fetch, and few
enough that a recovering replica needs the endpoints of a handful of members, not all of them."""


def source_rotation(healthy: Sequence[str], start: int) -> tuple[str, ...]:
    """The sources of a recovering rank whose first source is `healthy[start]`: up to
    `SOURCES_PER_RANK` healthy replicas from there on, wrapping around."""
    return tuple(
        healthy[(start + k) % len(healthy)] for k in range(min(SOURCES_PER_RANK, len(healthy)))
    )


MAX_MICRO_STEPS = 4096
"""The most micro-steps a replica may train in one step, and the largest even share."""

_NO_SHARES: Mapping[str, int] = MappingProxyType({})


def _no_shares() -> Mapping[str, int]:
    return _NO_SHARES


@dataclass(frozen=True, kw_only=True, slots=True)
class StepWork:
    """What a replica leader tells the service about its work with each Quorum call, for the
    fail-slow planner (`MicroSteps`)."""

    micro_steps: int | None = None
    """Micro-steps it trains in the step it asks for; None: its even share."""
    even: int = 1
    """The job's even share of micro-steps per replica and step."""
    max_micro_steps: int = 0
    """The most micro-steps it may train in one step (0: no limit)."""
    busy_seconds: float = 0.0
    """Compute time of its last committed step, waiting on others excluded (0: unknown)."""
    busy_micro_steps: int = 0
    """Micro-steps that step trained."""

    @property
    def declared(self) -> int:
        """Micro-steps it trains in the step it asks for."""
        return self.even if self.micro_steps is None else self.micro_steps


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroSteps:
    """Each member's share of a step's global batch, in micro-steps (forward and backward passes
    of the whole replica, accumulated into one gradient). A member not named trains `even`.

    The step's gradient is the sum of the healthy members' micro-step gradients divided by
    `total(healthy)`, so every micro-step weighs the same whichever replica trained it, and each
    healthy member's data position advances by what it trained (`trained_by`)."""

    even: int = 1
    """The even share."""
    trained: Mapping[str, int] = field(default_factory=_no_shares)
    """Members whose micro-steps in this step differ from `even`."""
    next: Mapping[str, int] = field(default_factory=_no_shares)
    """Members whose micro-steps in their next step differ from `even` (the planner's choice)."""

    def trained_by(self, replica_id: str) -> int:
        """Micro-steps `replica_id` trains in this step."""
        return self.trained.get(replica_id, self.even)

    def next_for(self, replica_id: str) -> int:
        """Micro-steps `replica_id` trains in its next step."""
        return self.next.get(replica_id, self.even)

    def total(self, healthy: tuple[str, ...]) -> int:
        """Micro-steps the healthy members train together in this step."""
        return sum(self.trained_by(r) for r in healthy)


@dataclass(frozen=True, kw_only=True, slots=True)
class Quorum:
    """A formed quorum, identical for every member of its round."""

    quorum_id: int
    """Membership epoch: grows on every membership change or reported commit failure (I3)."""
    members: tuple[Member, ...]
    """Members sorted by replica_id: this order is the ring order."""
    max_step: int
    """Largest step among the members."""
    healthy: tuple[str, ...]
    """Replica ids at max_step, sorted: the contributors of this step's gradient."""
    sources: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=_no_sources)
    """Recovering replica id -> per rank -> healthy source replica ids in preference order."""
    reason: str = ""
    """Why the quorum formed (for logs)."""
    micro_steps: MicroSteps = field(default_factory=MicroSteps)
    """Each member's share of the step's batch (fail-slow mitigation)."""

    def member(self, replica_id: str) -> Member:
        """The member named `replica_id`; KeyError if it is not in the quorum."""
        index = bisect.bisect_left(self.members, replica_id, key=lambda m: m.replica_id)
        if index < len(self.members) and self.members[index].replica_id == replica_id:
            return self.members[index]
        raise KeyError(replica_id)

    def is_member(self, replica_id: str) -> bool:
        """Whether `replica_id` is in the quorum."""
        try:
            self.member(replica_id)
        except KeyError:
            return False
        return True

    def is_healthy(self, replica_id: str) -> bool:
        """Whether `replica_id` is a member at max_step."""
        index = bisect.bisect_left(self.healthy, replica_id)
        return index < len(self.healthy) and self.healthy[index] == replica_id

    @property
    def num_healthy(self) -> int:
        """How many members contribute gradients this step."""
        return len(self.healthy)

    @property
    def recovering(self) -> tuple[str, ...]:
        """Members behind max_step, sorted: they catch up from `sources`."""
        return tuple(sorted(self.sources))

    def ring_of(self, replica_id: str) -> tuple[str, ...]:
        """`replica_id` and its ring neighbours (`ring_of`); KeyError if it is not a member."""
        index = bisect.bisect_left(self.members, replica_id, key=lambda m: m.replica_id)
        if index == len(self.members) or self.members[index].replica_id != replica_id:
            raise KeyError(replica_id)
        return _near(self.members, index, lambda m: m.replica_id)

    def needed_by(self, replica_id: str) -> tuple[str, ...]:
        """The members whose endpoints `replica_id`'s ranks use, sorted: itself, its ring
        neighbours and, when it recovers, its sources. KeyError if it is not a member."""
        needed = set(self.ring_of(replica_id))
        for per_rank in self.sources.get(replica_id, ()):
            needed.update(per_rank)
        return tuple(sorted(needed))


def ring_of(order: Sequence[str], replica_id: str) -> tuple[str, ...]:
    """`replica_id` and the members before and after it in the ring `order` (sorted replica
    ids, which `replica_id` is one of), sorted: rank i of a replica exchanges with rank i of
    those two only. O(log members)."""
    index = bisect.bisect_left(order, replica_id)
    if index == len(order) or order[index] != replica_id:
        raise KeyError(replica_id)
    return _near(order, index, str)


def _near(order: Sequence[_T], index: int, name: Callable[[_T], str]) -> tuple[str, ...]:
    near = {name(order[index - 1]), name(order[index]), name(order[(index + 1) % len(order)])}
    return tuple(sorted(near))


@dataclass(frozen=True, kw_only=True, slots=True)
class MembershipEvent:
    """One change of membership, pushed by Watch."""

    kind: EventKind
    """`snapshot` (first event of a stream), `joined`, `left`, `evicted` or `quorum`."""
    replica_id: str | None
    """The replica concerned; None for `snapshot` and `quorum`."""
    quorum_id: int
    """The latest quorum id when the event happened."""
    reason: str
    """Why it happened."""
    members: tuple[str, ...] = ()
    """`snapshot`: the registered replica ids; `quorum`: the quorum's members (sorted); empty for
    the other kinds (a watcher follows them from the snapshot)."""
    teardown: bool = False
    """`evicted`: the report asked for the replica to be torn down (a rank is dead or hung): its
    ranks exit, and node agents kill its processes."""
    incarnation: int | None = None
    """`joined`, `left`, `evicted`: the incarnation concerned."""
    incarnations: tuple[int, ...] = ()
    """`snapshot` of a stream filtered by replica ids: the incarnation of each of `members`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemberStatus:
    """A registered replica as the service sees it."""

    replica_id: str
    """The replica."""
    incarnation: int
    """Its current incarnation."""
    world_size: int
    """Its number of ranks."""
    step: int | None
    """The last step it asked a quorum for; None if it never asked."""
    live: bool
    """Heard from within the heartbeat timeout, or waiting in the current round."""
    waiting: bool
    """Waiting in the current round."""
    last_seen_ago: timedelta
    """Time since it was last heard from."""
    ranks: tuple[RankEndpoint, ...]
    """Its per-rank endpoints."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumSummary:
    """A quorum that formed, as kept in the service's history."""

    quorum_id: int
    """Its quorum id."""
    round: int
    """Formation counter (grows every round, even when the quorum id stays)."""
    members: tuple[str, ...]
    """Member replica ids, sorted."""
    max_step: int
    """Largest step among the members."""
    healthy: tuple[str, ...]
    """Members at max_step."""
    reason: str
    """Why it formed."""
    formed_at: datetime
    """Wall-clock time it formed (UTC)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StatusSnapshot:
    """The quorum service's state, for tooling."""

    quorum_id: int
    """The latest quorum id formed (0 if none)."""
    round: int
    """Formation counter of the latest round."""
    members: tuple[MemberStatus, ...]
    """Every registered replica, sorted by replica_id."""
    quorums: tuple[QuorumSummary, ...]
    """Recent quorums, oldest first."""
    leader_epoch: int = 0
    """Lease epoch of the answering leader (0 without a standby setup)."""
    failslow: tuple[FailSlowDecision, ...] = ()
    """The fail-slow planner's recent decisions, oldest first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FailSlowDecision:
    """A change the fail-slow planner made."""

    decided_at: datetime
    """When (UTC)."""
    step: int
    """The step of the round it decided in."""
    action: Literal["keep", "rebalance", "evict"]
    """keep: every replica its even share; rebalance: uneven shares; evict: slow replicas out."""
    shares: Mapping[str, int]
    """The shares it chose that differ from the even one."""
    evicted: tuple[str, ...]
    """The replicas it evicted."""
    reason: str
    """Why, with the predicted rate of each option."""


# ---- errors: one root, so callers can catch everything the quorum service raises ------------


class QuorumError(common_errors.ServiceError):
    """Root of every error the quorum service or its clients raise."""


class InvalidRequestError(QuorumError, ValueError):
    """The request is malformed (gRPC INVALID_ARGUMENT): fix the caller, retrying cannot help."""

    code = "invalid_argument"
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class StaleIncarnationError(QuorumError):
    """The caller's incarnation is no longer current: superseded by a newer Join, evicted, or left
    (gRPC FAILED_PRECONDITION). The replica must Join again."""

    code = "stale_incarnation"
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class UnknownReplicaError(StaleIncarnationError):
    """The service has no record of this replica or incarnation (never joined, or the service
    restarted without a durable store). Like a stale incarnation: Join again."""

    code = "unknown_replica"


class WorldSizeMismatchError(QuorumError):
    """The joining replica's world size differs from the current members' (FAILED_PRECONDITION)."""

    code = "world_size_mismatch"
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class MembershipTooLargeError(QuorumError):
    """Admitting the joining replica would make the membership's endpoints too large for the
    answers that carry them (Quorum, Status) to fit in one message (gRPC RESOURCE_EXHAUSTED)."""

    code = "membership_too_large"
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 422


class AuthError(QuorumError, common_errors.AuthError):
    """The request carried no valid bearer token (gRPC UNAUTHENTICATED)."""


class QuorumTimeoutError(QuorumError, TimeoutError):
    """The call's deadline passed (for Quorum: no quorum including the caller formed in time)."""

    code = "timeout"
    grpc_status = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class QuorumUnavailableError(QuorumError, ConnectionError):
    """The service could not be reached, or was shutting down, until the call's retry budget ran
    out (gRPC UNAVAILABLE)."""

    code = "unavailable"
    grpc_status = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class SupersededRequestError(QuorumError):
    """A newer Quorum request of the same replica replaced this one (gRPC ABORTED)."""

    code = "superseded"
    grpc_status = grpc.StatusCode.ABORTED
    http_status = 409


class InternalError(QuorumError):
    """The service failed unexpectedly (gRPC INTERNAL or an unmapped status)."""


ERROR_WIRE = common_errors.ErrorWire(
    (
        InternalError,
        InvalidRequestError,
        StaleIncarnationError,
        UnknownReplicaError,
        WorldSizeMismatchError,
        MembershipTooLargeError,
        AuthError,
        QuorumTimeoutError,
        QuorumUnavailableError,
        SupersededRequestError,
    ),
    # The client never cancels a unary call: CANCELLED is a server that stopped (a restart, a
    # shutdown whose grace ran out) with the call in flight. Another try, or instance, answers.
    grpc_transport={grpc.StatusCode.CANCELLED: QuorumUnavailableError},
    fallback=InternalError,
)
"""How a client maps a failed call back to its class (server-only errors such as a standby's
`NotLeaderError` arrive as what their status says: unavailable)."""
