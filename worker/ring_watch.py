"""Every rank's watch on the quorum service's membership events: a ring member's eviction aborts
the exchange at once, instead of after the exchange timeout (pushed failure notices, DESIGN.md);
so does a newer quorum formed without this replica (its ring's epoch can no longer commit: the
others moved on, and a rank still connecting or exchanging in it would wait for peers that never
come). Its own replica's eviction with a teardown (one of its ranks is dead or hung) calls
`on_teardown`, so this rank does not sit in a collective with the dead one until a timeout.

Only the replica leader holds a Watch stream; every other rank gets the events from its parent in
the replica's relay tree (`notice_relay`), and passes them on to its own children before acting
on them. A parent that dies without a goodbye is a dead rank of this replica: `on_teardown` too."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator

from fthsdp.services.quorum.client import MembershipEvent, QuorumClient, WatchStream
from fthsdp.worker.config import EXIT_TORN_DOWN, ManagerConfig
from fthsdp.worker.ftar import FtarRing
from fthsdp.worker.notice_relay import NoticeRelay, Upstream, UpstreamLost, encode_event, relay_key
from fthsdp.worker.plan import StepPlan
from fthsdp.worker.replica_group import ReplicaGroup

log = logging.getLogger(__name__)

_RETRY_S = 0.2


class RingWatch:
    """Follows the membership events in a daemon thread (`thread`, started by the owner), from
    the service (`upstream` None: the leader) or from the parent relay at `upstream`, and passes
    them on through `relay` (owned: closed by `close`); reconnects after a lost stream until
    `stop` is set."""

    def __init__(
        self,
        config: ManagerConfig,
        *,
        ring: FtarRing,
        plan: Callable[[], StepPlan | None],
        stop: threading.Event,
        rank: int,
        on_teardown: Callable[[MembershipEvent], None] | None = None,
        relay: NoticeRelay | None = None,
        upstream: str | None = None,
        incarnation: Callable[[], int] | None = None,
    ) -> None:
        self._config = config
        self._relay = relay
        self._upstream = upstream
        self._incarnation = incarnation
        """The leader's: its replica's current incarnation, which its stream keeps alive."""
        self._held: int | None = None
        """The incarnation the open stream keeps alive (its snapshot arrived), if any."""
        self._ring = ring
        self._plan = plan
        self._stop = stop
        self._rank = rank
        self._on_teardown = on_teardown
        self.live = threading.Event()
        """Set once a stream has delivered its first event (the service's snapshot)."""
        self._evicted: dict[str, int] = {}
        """Replica -> the latest quorum id when it was last evicted or left: no ring of that
        quorum or an older one that holds it can commit (a newer quorum holds a new
        incarnation, if any)."""
        self._evicted_lock = threading.Lock()
        self._stream: WatchStream | Upstream | None = None
        self._client = (
            QuorumClient(config.quorum_address, config.token) if upstream is None else None
        )
        self.thread = threading.Thread(target=self._run, name="fthsdp-watch", daemon=True)

    def close(self, timeout_s: float = 2.0) -> None:
        """With `stop` set: ends the stream, closes the channel (which cancels a stream being
        opened right now), says goodbye to the relay's children and waits for the thread, so no
        gRPC call outlives the Manager."""
        if self._stream is not None:
            self._stream.cancel()
        if self._client is not None:
            self._client.close()
        if self._relay is not None:
            self._relay.close()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event, payload in self._events():
                    if self._stop.is_set():
                        break
                    self.live.set()
                    if self._relay is not None:  # children first: they act in parallel
                        self._relay.forward(payload, snapshot=event.kind == "snapshot")
                    self._handle(event)
            except UpstreamLost as exc:
                if not self._stop.is_set():
                    self._parent_died(str(exc))
            except Exception as exc:
                log.debug("watch stream ended: %s", exc, extra=self._context())
            self._stop.wait(_RETRY_S)

    def _events(self) -> Iterator[tuple[MembershipEvent, bytes]]:
        if self._upstream is not None:
            upstream = Upstream(self._upstream, relay_key(self._config.token))
            self._stream = upstream
            yield from upstream
            return
        assert self._client is not None
        incarnation = self._incarnation() if self._incarnation is not None else None
        holder = None if incarnation is None else (self._config.replica_id, incarnation)
        # Joins change nothing for the ranks (their plans come with the quorum answers).
        stream = self._stream = self._client.watch(holder=holder, without_joins=True)
        try:
            for event in stream:
                if event.kind == "snapshot" and incarnation is not None:
                    # The service names the incarnation it keeps alive (none for a stale one).
                    self._held = incarnation if event.incarnation == incarnation else None
                yield event, encode_event(event) if self._relay is not None else b""
        finally:
            self._held = None

    def holds(self, incarnation: int) -> bool:
        """Whether the open stream keeps `incarnation` alive (no heartbeat needed)."""
        return self._held == incarnation

    def renew_for(self, incarnation: int) -> None:
        """After a rejoin: ends a stream that keeps an older incarnation alive, so the next one
        holds `incarnation` (the thread reopens it after its 0.2 s retry pause)."""
        held, stream = self._held, self._stream
        if held is not None and held != incarnation and stream is not None:
            stream.cancel()

    def _parent_died(self, reason: str) -> None:
        """The rank feeding this one died: this replica lost a rank, as a teardown says."""
        log.error(
            "the parent rank's relay ended without a goodbye: %s",
            reason,
            extra=self._context(parent=self._upstream),
        )
        if self._on_teardown is not None:
            self._on_teardown(
                MembershipEvent(
                    kind="evicted",
                    replica_id=self._config.replica_id,
                    quorum_id=0,
                    reason=f"a rank of this replica died ({reason})",
                    teardown=True,
                )
            )

    def _handle(self, event: MembershipEvent) -> None:
        own = event.replica_id == self._config.replica_id
        if event.kind == "evicted" and own and event.teardown:
            log.error(
                "this replica was evicted for a teardown: %s",
                event.reason,
                extra=self._context(incarnation=event.incarnation),
            )
            if self._on_teardown is not None:
                self._on_teardown(event)
            return
        plan = self._plan()
        if event.kind == "quorum":
            self._on_quorum(event, plan)
            return
        if event.kind not in ("evicted", "left") or own or event.replica_id is None:
            return
        with self._evicted_lock:
            self._evicted[event.replica_id] = event.quorum_id
        # A member that left did so after committing its last step, so the exchange in flight
        # may well complete (its data is sent); if not, its closed sockets fail it at once. Only
        # an evicted member (dead, hung, cut off) can leave its peers waiting. Aborting on a
        # leave made the last replica to finish an exchange fail the job's final step.
        while (
            event.kind == "evicted"
            and plan is not None
            and _holds(plan, event.replica_id, event.quorum_id)
        ):
            log.info(
                "ring member evicted; aborting the exchange",
                extra=self._context(evicted=event.replica_id),
            )
            # Sticky for the plan's epoch: this rank may not have started rebuilding its ring
            # for it yet, and would then wait for the gone member until the connect timeout. A
            # ring already at a newer epoch is left alone (`FtarRing.abort`): the training
            # thread may have moved on to a newer plan meanwhile, which is checked in turn.
            self._ring.abort(epoch=plan.quorum_id)
            newer = self._plan()
            if newer is None or newer.quorum_id <= plan.quorum_id:
                break
            plan = newer

    def gone_from(self, plan: StepPlan) -> str | None:
        """A member of `plan`'s ring that was evicted (or left) after the plan's quorum formed,
        so the plan cannot commit; None if there is none. The training thread asks before it
        rebuilds its ring: the eviction may have come while an older plan was current."""
        with self._evicted_lock:
            evicted = list(self._evicted.items())
        for replica_id, quorum_id in evicted:
            if replica_id != self._config.replica_id and _holds(plan, replica_id, quorum_id):
                return replica_id
        return None

    def _on_quorum(self, event: MembershipEvent, plan: StepPlan | None) -> None:
        epoch = self._ring.epoch
        if (
            plan is None
            or epoch is None
            or epoch >= event.quorum_id
            or self._config.replica_id in event.members
        ):
            return  # a member's leader asked for it: its ranks are past their last exchange
        log.info(
            "quorum formed without this replica; aborting the ring",
            extra=self._context(quorum_id=event.quorum_id, epoch=epoch),
        )
        self._ring.abort(f"superseded by quorum {event.quorum_id}, which left this replica out")

    def _context(self, **fields: object) -> dict[str, object]:
        return {"replica_id": self._config.replica_id, "rank": self._rank, **fields}


def _holds(plan: StepPlan, replica_id: str, evicted_at: int) -> bool:
    """Whether `plan`'s ring holds the incarnation of `replica_id` evicted when `evicted_at`
    was the latest quorum id: a quorum formed after the eviction has a larger id (its
    membership changed) and holds a new incarnation, if any."""
    return replica_id in plan.ring_replicas and plan.quorum_id <= evicted_at


def exit_for_restart(
    group: ReplicaGroup,
    context: Callable[..., dict[str, object]],
    leave: Callable[[str], None],
    event: MembershipEvent,
) -> None:
    """The Manager's `on_teardown` (with `ManagerConfig.exit_on_teardown`): whatever the training
    thread is blocked in (a collective with a dead or hung rank) ends with the process, which
    exits `EXIT_TORN_DOWN` for its process manager to restart it. It first tells the health
    service it leaves (`leave`), so its silence is not taken for the fault: the dead rank, whose
    last beat may come after this one's, is the one to name."""
    log.error(
        "replica torn down: exiting with %d for a restart",
        EXIT_TORN_DOWN,
        extra=context(reason=event.reason),
    )
    leave(f"torn down: {event.reason}")
    group.abort()
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_TORN_DOWN)
