"""Pure quorum logic: membership state, the round decision, quorum formation, source assignment.

No I/O, no clock: every function takes `now` (monotonic seconds) so timeouts are tested without
sleeping. `decide(now, state, config)` returns `(decision, reason)` like torchft's
`quorum_compute`, with two differences argued here:

* the majority and `min_replicas` checks (I6) apply to the fast path too: a service that answers
  every replica cannot be split in two, but a quorum formed by a minority of the live replicas
  would let the majority commit a different history later;
* liveness counts a replica waiting in the round as live, so a long-poll never needs a parallel
  heartbeat; the wire layer drops a waiter whose RPC is cancelled (a killed client).

`CoreState` keeps small incremental indexes (who has not asked, how many previous members asked)
so that a decision while a round fills costs O(1) in the common case, not O(replicas): a round of
N arrivals is O(N), not O(N^2)."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from fthsdp.services.common.parse import MAX_STEP, host_port
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.domain import (
    MAX_WATCHED_REPLICAS,
    InvalidRequestError,
    Member,
    MicroSteps,
    Quorum,
    RankEndpoint,
    StaleIncarnationError,
    StepWork,
    UnknownReplicaError,
    source_rotation,
)

MAX_ID_CHARS = 128
MAX_WORLD_SIZE = 4096
MAX_ADDRESS_CHARS = 256
MAX_REASON_CHARS = 1024
MAX_MEMBERSHIP_BYTES = 56 * 1024 * 1024
"""Budget of all registered replicas' endpoints in one answer (Status lists them all; a Quorum
answer only those its caller needs): the messages are capped at 64 MiB, and the rest of an
answer is far below the 8 MiB left."""
_RANK_OVERHEAD = 12  # protobuf tags and lengths of one RankEndpoint inside a member
_MEMBER_OVERHEAD = 64 + MAX_ID_CHARS  # a member's id, incarnation, step and framing


# ---- domain records -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Registration:
    """A joined replica: what Join recorded."""

    replica_id: str
    """Stable name of the replica."""
    incarnation: int
    """Its current incarnation."""
    world_size: int
    """Its number of ranks."""
    ranks: tuple[RankEndpoint, ...]
    """Per-rank endpoints, in rank order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ask:
    """A replica waiting in the current round."""

    replica_id: str
    """The asking replica."""
    incarnation: int
    """Its incarnation (equal to the registered one: checked before it is added)."""
    step: int
    """The step it is about to train."""
    commit_failed: bool
    """Its previous attempt failed to commit (forces a new quorum id)."""
    arrived: float
    """When it asked (monotonic seconds)."""
    work: StepWork = field(default_factory=StepWork)
    """Its micro-steps and speed (fail-slow mitigation)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumRecord:
    """A formed quorum as the store keeps it (membership epoch, not endpoints)."""

    quorum_id: int
    """The quorum id."""
    round: int
    """Formation counter."""
    members: tuple[tuple[str, int], ...]
    """(replica_id, incarnation) of the members, sorted."""
    max_step: int
    """Largest step among the members."""
    healthy: tuple[str, ...]
    """Members at max_step."""
    reason: str
    """Why it formed."""
    formed_unix: float
    """Wall-clock time it formed (seconds since the Unix epoch)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What a round should do now."""

    form: bool
    """Form the quorum now with every waiting replica."""
    wake_at: float | None = None
    """When not forming: when the decision may change if nothing else happens (monotonic
    seconds); None when only an arrival or an eviction can change it."""
    path: str = "wait"
    """Short label for metrics: `fast`, `all_asked`, `join_timeout` or `wait`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Formation:
    """The outcome of forming a round."""

    quorum: Quorum
    """What every participant is told."""
    record: QuorumRecord
    """What the store keeps."""
    participants: tuple[Ask, ...]
    """The asks answered by this round, in replica_id order."""


# ---- validation at the boundary (pure; raises InvalidRequestError) -------------------------


def check_id(value: str, what: str = "replica_id") -> str:
    """A replica id (or reporter): 1..128 printable characters without whitespace."""
    if not value:
        raise InvalidRequestError(f"{what} must not be empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequestError(f"{what} must have at most {MAX_ID_CHARS} characters")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise InvalidRequestError(f"{what} must be printable and contain no whitespace")
    return value


def check_watched(ids: Sequence[str]) -> frozenset[str] | None:
    """The replicas a Watch stream is filtered to (None: not filtered), each a valid id, at most
    `MAX_WATCHED_REPLICAS`."""
    if not ids:
        return None
    if len(ids) > MAX_WATCHED_REPLICAS:
        raise InvalidRequestError(
            f"a Watch stream follows at most {MAX_WATCHED_REPLICAS} replicas, got {len(ids)}"
        )
    return frozenset(check_id(rid) for rid in ids)


def check_reason(value: str) -> str:
    """A free-text reason: at most 1024 characters."""
    if len(value) > MAX_REASON_CHARS:
        raise InvalidRequestError(f"reason must have at most {MAX_REASON_CHARS} characters")
    return value


def check_step(step: int) -> int:
    """A training step: in 0..MAX_STEP."""
    if not 0 <= step <= MAX_STEP:
        raise InvalidRequestError(f"step must be in 0..{MAX_STEP}, got {step}")
    return step


def check_ranks(world_size: int, ranks: Sequence[RankEndpoint]) -> tuple[RankEndpoint, ...]:
    """One well-formed endpoint per rank, 1 <= world_size <= 4096."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise InvalidRequestError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
    if len(ranks) != world_size:
        raise InvalidRequestError(
            f"expected one endpoint per rank ({world_size}), got {len(ranks)}"
        )
    for rank, endpoint in enumerate(ranks):
        _check_ftar(rank, endpoint.ftar)
        _check_url(rank, endpoint.checkpoint)
    return tuple(ranks)


def membership_bytes(ranks: Sequence[RankEndpoint]) -> int:
    """An upper bound of one replica's share of every answer that lists the membership."""
    return _MEMBER_OVERHEAD + sum(
        len(r.ftar.encode()) + len(r.checkpoint.encode()) + _RANK_OVERHEAD for r in ranks
    )


def _check_ftar(rank: int, address: str) -> None:
    if not address or len(address) > MAX_ADDRESS_CHARS:
        raise InvalidRequestError(
            f"rank {rank}: ftar address must have 1..{MAX_ADDRESS_CHARS} chars"
        )
    try:
        host_port(address)
    except ValueError:
        raise InvalidRequestError(
            f"rank {rank}: ftar address must be host:port, got {address!r}"
        ) from None


def _check_url(rank: int, url: str) -> None:
    if not url or len(url) > MAX_ADDRESS_CHARS:
        raise InvalidRequestError(
            f"rank {rank}: checkpoint URL must have 1..{MAX_ADDRESS_CHARS} chars"
        )
    if not url.startswith(("http://", "https://")) or any(c.isspace() for c in url):
        raise InvalidRequestError(f"rank {rank}: checkpoint URL must be http(s)://..., got {url!r}")


# ---- state ----------------------------------------------------------------------------------


class CoreState:
    """Membership, liveness and the current round, with incremental indexes.

    Mutable on purpose (the service mutates it on the event loop, never concurrently); `decide`
    and `form` only read it. Invariants: `waiting` is a subset of `registered` with matching
    incarnations; `not_waiting` = registered - waiting; `expected` = members of `previous` that
    are still registered with the same incarnation; `expected_waiting` = |expected & waiting|;
    `newcomers` = registered incarnations that have not asked yet (minus restored members)."""

    __slots__ = (
        "ask_gap",
        "expected",
        "expected_waiting",
        "held",
        "issued",
        "last_ask",
        "last_quorum_id",
        "last_seen",
        "last_step",
        "member_bytes",
        "membership_bytes",
        "missed_catchup",
        "newcomers",
        "not_waiting",
        "previous",
        "registered",
        "round_started",
        "rounds",
        "slow_catchup",
        "waiting",
    )

    def __init__(self, *, last: QuorumRecord | None = None, epoch_floor: int = 0) -> None:
        self.registered: dict[str, Registration] = {}
        self.member_bytes: dict[str, int] = {}
        """Each registered replica's `membership_bytes`, computed once at its join."""
        self.membership_bytes = 0
        """Their sum: an answer listing the membership stays under it (Join admission checks it
        in O(1), not O(registered ranks) per Join: O(replicas^2) while a job starts)."""
        self.issued: dict[str, int] = {}
        self.held: dict[str, tuple[int, int]] = {}
        """Replica -> (incarnation, open streams): its leader's Watch streams that keep it alive
        without heartbeats (`hold`)."""
        self.last_seen: dict[str, float] = {}
        self.last_ask: dict[str, float] = {}
        self.ask_gap: dict[str, float] = {}
        """Replica -> its usual time between Quorum calls (smoothed): its step time."""
        self.last_step: dict[str, int] = {}
        self.waiting: dict[str, Ask] = {}
        self.not_waiting: set[str] = set()
        self.newcomers: set[str] = set()
        self.previous: QuorumRecord | None = last
        self.expected: set[str] = set()
        self.expected_waiting = 0
        self.last_quorum_id = max(last.quorum_id if last else 0, epoch_floor)
        self.rounds = last.round if last else 0
        self.round_started: float | None = None
        self.missed_catchup: set[str] = set()
        """Replicas that were catching up in a quorum and not in the next one: their catch-up
        outlasted the join timeout. Forgotten once they are healthy in a quorum."""
        self.slow_catchup: set[str] = set()
        """Those of them catching up again in `previous`: the round waits up to the catch-up
        timeout for them (`decide`)."""

    # -- membership --

    def register(self, reg: Registration, now: float) -> Registration | None:
        """Adds (or replaces with a newer incarnation) a replica; returns the superseded one."""
        old = self.remove(reg.replica_id)
        self.held.pop(reg.replica_id, None)  # streams of another incarnation keep nothing alive
        self.registered[reg.replica_id] = reg
        size = self.member_bytes[reg.replica_id] = membership_bytes(reg.ranks)
        self.membership_bytes += size
        self.issued[reg.replica_id] = max(self.issued.get(reg.replica_id, 0), reg.incarnation)
        self.not_waiting.add(reg.replica_id)
        self.last_seen[reg.replica_id] = now
        if self.previous is not None and (reg.replica_id, reg.incarnation) in self.previous.members:
            self.expected.add(reg.replica_id)  # restored from a store after a restart
        else:
            self.newcomers.add(reg.replica_id)
        return old

    def remove(self, replica_id: str) -> Registration | None:
        """Forgets a replica (evicted, left, superseded); returns its registration if any."""
        reg = self.registered.pop(replica_id, None)
        if reg is None:
            return None
        self.membership_bytes -= self.member_bytes.pop(replica_id)
        self.held.pop(replica_id, None)
        self.drop_ask(replica_id)
        self.not_waiting.discard(replica_id)
        self.newcomers.discard(replica_id)
        self.missed_catchup.discard(replica_id)
        self.slow_catchup.discard(replica_id)
        self.last_seen.pop(replica_id, None)
        self.last_ask.pop(replica_id, None)
        self.ask_gap.pop(replica_id, None)
        self.last_step.pop(replica_id, None)
        self.expected.discard(replica_id)
        return reg

    def check(self, replica_id: str, incarnation: int) -> Registration:
        """The registration `(replica_id, incarnation)` names, or the precondition error."""
        reg = self.registered.get(replica_id)
        if reg is not None and reg.incarnation == incarnation:
            return reg
        issued = self.issued.get(replica_id, 0)
        if reg is not None and incarnation < reg.incarnation:
            raise StaleIncarnationError(
                f"stale incarnation: {replica_id} incarnation {incarnation} was superseded by "
                f"{reg.incarnation}; join again"
            )
        if reg is None and 0 < incarnation <= issued:
            raise StaleIncarnationError(
                f"stale incarnation: {replica_id} incarnation {incarnation} is no longer a member "
                "(evicted or left); join again"
            )
        raise UnknownReplicaError(
            f"unknown replica: {replica_id} incarnation {incarnation} never joined; join first"
        )

    def touch(self, replica_id: str, now: float) -> None:
        """Records a sign of life."""
        if replica_id in self.registered:
            self.last_seen[replica_id] = max(now, self.last_seen.get(replica_id, now))

    def silent_for(self, replica_id: str, now: float) -> float:
        """Seconds since the replica last called the service or waited in a round; its Watch
        stream does not count (0 while it waits in the round)."""
        if replica_id in self.waiting:
            return 0.0
        return max(0.0, now - self.last_seen.get(replica_id, now))

    def seen(self, replica_id: str, now: float) -> float:
        """When the replica was last known alive: now while a stream holds it."""
        return now if replica_id in self.held else self.last_seen[replica_id]

    def hold(self, replica_id: str, incarnation: int) -> None:
        """One more open stream of this incarnation keeps the replica alive; raises as `check`
        does for an incarnation that is not the current one."""
        self.check(replica_id, incarnation)
        inc, count = self.held.get(replica_id, (incarnation, 0))
        self.held[replica_id] = (incarnation, count + 1 if inc == incarnation else 1)

    def release(self, replica_id: str, incarnation: int, now: float) -> None:
        """One such stream ended: when it was the last, the heartbeat timeout runs from now."""
        inc, count = self.held.get(replica_id, (0, 0))
        if inc != incarnation or count == 0:
            return  # superseded or removed meanwhile: nothing of this incarnation is held
        if count > 1:
            self.held[replica_id] = (inc, count - 1)
            return
        del self.held[replica_id]
        self.touch(replica_id, now)

    # -- the round --

    def add_ask(self, ask: Ask) -> None:
        """Adds (or replaces, for a retried call) a replica's ask to the current round."""
        rid = ask.replica_id
        if rid not in self.waiting:
            self.not_waiting.discard(rid)
            self.newcomers.discard(rid)
            if rid in self.expected:
                self.expected_waiting += 1
        self.waiting[rid] = ask
        previous = self.last_ask.get(rid)
        if previous is not None and ask.arrived > previous:
            gap = ask.arrived - previous
            self.ask_gap[rid] = 0.7 * self.ask_gap.get(rid, gap) + 0.3 * gap
        self.last_ask[rid] = ask.arrived
        self.last_step[rid] = ask.step
        self.last_seen[rid] = max(ask.arrived, self.last_seen.get(rid, ask.arrived))
        if self.round_started is None:
            self.round_started = ask.arrived

    def drop_ask(self, replica_id: str) -> Ask | None:
        """Removes a replica from the current round (its RPC was cancelled, or it was evicted)."""
        ask = self.waiting.pop(replica_id, None)
        if ask is None:
            return None
        if replica_id in self.registered:
            self.not_waiting.add(replica_id)
        if replica_id in self.expected:
            self.expected_waiting -= 1
        if not self.waiting:
            self.round_started = None
        return ask

    def apply(self, formation: Formation, now: float) -> None:
        """Records a formed round and starts the next, empty one."""
        record = formation.record
        self._note_catchups(self.previous, record)
        self.previous = record
        self.last_quorum_id = record.quorum_id
        self.rounds = record.round
        for rid in self.waiting:
            self.not_waiting.add(rid)
            self.last_seen[rid] = now  # waiting counted as live until now
        self.waiting.clear()
        self.round_started = None
        self.expected = {
            rid
            for rid, incarnation in record.members
            if (reg := self.registered.get(rid)) is not None and reg.incarnation == incarnation
        }
        self.expected_waiting = 0

    def _note_catchups(self, old: QuorumRecord | None, new: QuorumRecord) -> None:
        """Which replicas' catch-ups outlast the join timeout (`missed_catchup`, `slow_catchup`)."""
        healthy = set(new.healthy)
        if old is not None and len(old.healthy) < len(old.members):  # someone was catching up
            members = {rid for rid, _ in new.members}
            for rid, incarnation in old.members:
                reg = self.registered.get(rid)
                missed = rid not in old.healthy and rid not in members
                if missed and reg is not None and reg.incarnation == incarnation:
                    self.missed_catchup.add(rid)
        if not self.missed_catchup:
            self.slow_catchup = set()  # the steady state: nothing per member to look at
            return
        self.missed_catchup -= healthy
        self.slow_catchup = {
            rid for rid, _ in new.members if rid not in healthy and rid in self.missed_catchup
        }

    def counts(self, replica_id: str) -> bool:
        """Whether a round waits for this registered replica and counts it among the live ones.
        Once a quorum exists, a new incarnation that has not asked yet does not count: it is
        restarting (importing, loading, restoring), trains nothing, and joins the round it
        asks in. Waiting for it would stall the survivors of every failure that overlaps its
        recovery, and counting it could deny them a majority they have. Before the first
        quorum every replica is new, and the job waits for its replicas to arrive."""
        return self.previous is None or replica_id not in self.newcomers

    def is_live(self, replica_id: str, now: float, timeout: float) -> bool:
        """Waiting in the round, or heard from within `timeout` seconds."""
        if replica_id in self.waiting:
            return True
        if replica_id not in self.last_seen:
            return False
        return now - self.seen(replica_id, now) < timeout


# ---- decisions ------------------------------------------------------------------------------


def decide(now: float, state: CoreState, config: QuorumConfig) -> tuple[Decision, str]:
    """Whether the current round forms now, and why (or why not).

    Rules, in order: nobody waiting -> wait. Fewer than `min_replicas` waiting, or not a strict
    majority of the live replicas (I6) -> wait. Every member of the previous quorum that is still
    registered is waiting (fast path) -> form now with everyone waiting, newcomers included. Every
    live replica is waiting -> form. The join timeout (counted from the round's first ask) has
    passed -> form with whoever waits. Otherwise wait for the stragglers until the join timeout
    or until one of them expires. A restarting newcomer that has not asked yet is neither waited
    for nor counted as live (`CoreState.counts`). A replica catching up again after its last
    catch-up missed a round (`CoreState.slow_catchup`) is waited for until the catch-up timeout
    instead of the join timeout, so it rejoins rather than falling behind forever."""
    asked = len(state.waiting)
    if asked == 0 or state.round_started is None:
        return Decision(form=False), "no replica is waiting"
    hb = config.heartbeat_timeout.total_seconds()
    join_deadline = state.round_started + config.join_timeout.total_seconds()
    fast = bool(state.expected) and state.expected_waiting == len(state.expected)
    if not fast and now < join_deadline:
        # Common case while a round fills: a live replica has not asked yet. O(1) in practice.
        for rid in state.not_waiting:
            if now - state.seen(rid, now) < hb and state.counts(rid):
                return Decision(form=False, wake_at=join_deadline), (
                    f"{asked} asked; waiting for live replicas that have not (e.g. {rid})"
                )
    stragglers = [
        state.seen(r, now) + hb
        for r in state.not_waiting
        if now - state.seen(r, now) < hb and state.counts(r)
    ]
    live = asked + len(stragglers)
    next_expiry = min(stragglers) if stragglers else None
    if asked < config.min_replicas:
        return Decision(form=False, wake_at=next_expiry), (
            f"{asked} asked; need min_replicas={config.min_replicas}"
        )
    if 2 * asked <= live:
        return Decision(form=False, wake_at=next_expiry), (
            f"{asked} asked of {live} live replicas: not a majority (no split brain)"
        )
    if fast:
        return Decision(form=True, path="fast"), (
            f"fast path: every member of quorum {state.last_quorum_id} asked ({asked} waiting)"
        )
    if not stragglers:
        return Decision(form=True, path="all_asked"), f"all {asked} live replicas asked"
    if now >= join_deadline:
        slow = _slow_catchup_waited(now, state, config, hb)
        if slow is None:
            return Decision(form=True, path="join_timeout"), (
                f"join timeout: forming with {asked} of {live} live replicas"
            )
        rid, deadline = slow
        wake = deadline if next_expiry is None else min(deadline, next_expiry)
        return Decision(form=False, wake_at=wake), (
            f"{asked} of {live} live replicas asked; waiting for {rid}, catching up again after "
            "its last catch-up outlasted the join timeout, until the catch-up timeout"
        )
    wake = join_deadline if next_expiry is None else min(join_deadline, next_expiry)
    return Decision(form=False, wake_at=wake), (
        f"{asked} of {live} live replicas asked; waiting for stragglers until the join timeout"
    )


def _slow_catchup_waited(
    now: float, state: CoreState, config: QuorumConfig, hb: float
) -> tuple[str, float] | None:
    """A live straggler of `slow_catchup` whose catch-up deadline has not passed, and that
    deadline (None when there is none: the common case, an empty set)."""
    if not state.slow_catchup or state.round_started is None:
        return None
    deadline = (
        state.round_started + max(config.join_timeout, config.catchup_timeout).total_seconds()
    )
    if now >= deadline:
        return None
    for rid in sorted(state.slow_catchup & state.not_waiting):
        if now - state.seen(rid, now) < hb and state.counts(rid):
            return rid, deadline
    return None


def expired(now: float, state: CoreState, config: QuorumConfig) -> tuple[list[str], float | None]:
    """Replicas whose heartbeat timed out (waiting ones never do), and the next expiry time."""
    hb = config.heartbeat_timeout.total_seconds()
    gone: list[str] = []
    next_expiry: float | None = None
    for rid in state.not_waiting:
        expiry = state.seen(rid, now) + hb
        if expiry <= now:
            gone.append(rid)
        elif next_expiry is None or expiry < next_expiry:
            next_expiry = expiry
    return sorted(gone), next_expiry


def even_share(asks: Iterable[Ask]) -> int:
    """The even share most asks declare (the larger on a tie): one job has one, but a replica
    started with another value must not make the round's answer depend on arrival order."""
    evens = collections.Counter(a.work.even for a in asks)
    return max(evens, key=lambda e: (evens[e], e))


def form(
    now: float,
    state: CoreState,
    *,
    reason: str,
    formed_unix: float,
    next_shares: Mapping[str, int] | None = None,
) -> Formation:
    """The quorum of every replica waiting now. Pure: `state.apply` records it afterwards.

    The quorum id grows when the membership (replica ids and incarnations) differs from the
    previous quorum's or any participant reports a failed commit (I3); otherwise it stays.
    `next_shares`: the fail-slow planner's micro-steps for the members' next step (absent: each
    its even share)."""
    del now  # the formation itself is timeless; kept for the (now, state, ...) shape
    asks = tuple(sorted(state.waiting.values(), key=lambda a: a.replica_id))
    members = tuple(
        Member(
            replica_id=a.replica_id,
            incarnation=a.incarnation,
            step=a.step,
            ranks=state.registered[a.replica_id].ranks,
        )
        for a in asks
    )
    identity = tuple((a.replica_id, a.incarnation) for a in asks)
    max_step = max(a.step for a in asks)
    healthy = tuple(a.replica_id for a in asks if a.step == max_step)
    changed = state.previous is None or state.previous.members != identity
    failed = any(a.commit_failed for a in asks)
    quorum_id = state.last_quorum_id + 1 if changed or failed else state.last_quorum_id
    recovering = [
        (a.replica_id, len(state.registered[a.replica_id].ranks)) for a in asks if a.step < max_step
    ]
    quorum = Quorum(
        quorum_id=quorum_id,
        members=members,
        max_step=max_step,
        healthy=healthy,
        sources=MappingProxyType(assign_sources(healthy, recovering)),
        reason=reason,
        micro_steps=_micro_steps(asks, max_step, next_shares or {}),
    )
    record = QuorumRecord(
        quorum_id=quorum_id,
        round=state.rounds + 1,
        members=identity,
        max_step=max_step,
        healthy=healthy,
        reason=reason,
        formed_unix=formed_unix,
    )
    return Formation(quorum=quorum, record=record, participants=asks)


def _micro_steps(asks: Sequence[Ask], max_step: int, next_shares: Mapping[str, int]) -> MicroSteps:
    even = even_share(asks)
    trained = {
        a.replica_id: a.work.declared
        for a in asks
        if a.step == max_step and a.work.declared != even
    }
    upcoming = {rid: k for rid, k in next_shares.items() if k != even}
    if not trained and not upcoming:
        return MicroSteps(even=even)
    return MicroSteps(even=even, trained=MappingProxyType(trained), next=MappingProxyType(upcoming))


def assign_sources(
    healthy: Sequence[str], recovering: Iterable[tuple[str, int]]
) -> dict[str, tuple[tuple[str, ...], ...]]:
    """For each (recovering replica, world size): per rank, up to `SOURCES_PER_RANK` healthy
    replicas in preference order.

    Every (replica, rank) to serve gets the next slot of one global round-robin over `healthy`,
    and its list is the first `SOURCES_PER_RANK` of `healthy` rotated to start at that slot
    (`source_rotation`). So the ranks of one recovering replica start at different healthy
    replicas (as long as there are enough), and no healthy replica is primary for more than
    ceil(ranks to serve / healthy) ranks."""
    pool = tuple(healthy)
    if not pool:
        return {}
    rotations: dict[int, tuple[str, ...]] = {}
    out: dict[str, tuple[tuple[str, ...], ...]] = {}
    slot = 0
    for replica_id, world_size in recovering:
        per_rank: list[tuple[str, ...]] = []
        for _ in range(world_size):
            start = slot % len(pool)
            rotation = rotations.get(start)
            if rotation is None:
                rotation = rotations[start] = source_rotation(pool, start)
            per_rank.append(rotation)
            slot += 1
        out[replica_id] = tuple(per_rank)
    return out
