"""The quorum service's behaviour on an asyncio loop, without any wire: rounds, timers, evictions,
events. The gRPC layer (`server.py`) only converts messages and maps errors.

Concurrency model: every state change runs synchronously on the event loop, between awaits, so
no lock guards `CoreState`; the only awaits are store calls, after which preconditions are
checked again. A round is evaluated on every arrival and when the core's `wake_at` timer fires
(one `call_later` handle, re-armed only when the deadline moves); heartbeat expiry is a sleeping
task that wakes at the earliest expiry. Nothing polls in a loop.

A killed client's long-poll must not count forever: when its RPC is cancelled the waiter is
dropped from the round at once (and the replica stays live only for the heartbeat timeout)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

from fthsdp.services.quorum import core, status
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.core import Ask, CoreState, Formation, Registration
from fthsdp.services.quorum.domain import (
    EventKind,
    MembershipEvent,
    MembershipTooLargeError,
    RankEndpoint,
    StaleIncarnationError,
    StatusSnapshot,
    SupersededRequestError,
    UnknownReplicaError,
    WorldSizeMismatchError,
)
from fthsdp.services.quorum.errors import (
    NotLeaderError,
    ShuttingDownError,
    StoreUnavailableError,
)
from fthsdp.services.quorum.events import EventHub, Subscription
from fthsdp.services.quorum.failslow import FailSlowPlanner, Policy
from fthsdp.services.quorum.metrics import QuorumMetrics
from fthsdp.services.quorum.rounds import QuorumAsk, RoundTiming, Tally, Waiter
from fthsdp.services.quorum.store import QuorumStore

log = logging.getLogger(__name__)

_TIMER_SLACK = 0.001  # fire just after a deadline, never just before it (no re-arm churn)


class Coordinator:
    """Membership and rounds of one quorum service (single event loop)."""

    def __init__(
        self,
        config: QuorumConfig,
        store: QuorumStore,
        *,
        metrics: QuorumMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._store = store
        self._metrics = metrics or QuorumMetrics()
        self._clock = clock
        self._wall = wall
        self._state = CoreState()
        self._failslow = FailSlowPlanner(
            cast(Policy, config.failslow_policy),
            horizon_s=config.failslow_horizon.total_seconds(),
            evict_cost_s=config.failslow_evict_cost.total_seconds(),
            min_replicas=config.min_replicas,
        )
        self._waiters: dict[str, Waiter] = {}
        self._answered: dict[str, tuple[int, int, Formation]] = {}
        self._events = EventHub(config.watch_queue_size)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._store_lock = asyncio.Lock()
        self._closing = False
        self._unsaved: int | None = None
        """A new quorum id applied here but not persisted (the store was down): not answered
        until a later round persists it."""
        self._store_down_logged = False
        self.round_timings: deque[RoundTiming] = deque(maxlen=4096)
        """Recent server-side round latencies (benchmarks read them)."""

    @property
    def state(self) -> CoreState:
        """The live state (read it; mutate only through the coordinator)."""
        return self._state

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, *, sweep: bool = True) -> None:
        """Restores epochs and membership from the store and starts the expiry task."""
        last = await self._store.last_quorum()
        self._state = CoreState(last=last, epoch_floor=await self._store.epoch_floor())
        # Restored members get two heartbeat timeouts to show up: their clients are failing
        # over to this instance with backoff and must not be evicted for the takeover itself.
        shows_up_by = self._clock() + self._config.heartbeat_timeout.total_seconds()
        for reg in await self._store.members():
            self._state.register(reg, shows_up_by)
        self._metrics.quorum_id.set(self._state.last_quorum_id)
        self._metrics.members.set(len(self._state.registered))
        if sweep:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="quorum-expiry")

    async def close(self) -> None:
        """Fails waiting calls with ShuttingDownError, ends Watch streams, stops timers."""
        if self._closing:
            return
        self._closing = True
        self._cancel_timer()
        if self._sweeper is not None:
            self._sweeper.cancel()
            # asyncio.wait, not `await` under suppress(CancelledError): that would also absorb
            # a cancellation of close()'s own caller.
            await asyncio.wait({self._sweeper})
        waiters = list(self._waiters.values())
        self._waiters.clear()
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(ShuttingDownError("the quorum service is stopping"))
        self._events.end_all()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)

    # ---- RPC behaviour ------------------------------------------------------------------------

    async def join(
        self, replica_id: str, world_size: int, ranks: Sequence[RankEndpoint]
    ) -> tuple[int, int]:
        """Registers a process start; returns (new incarnation, latest quorum id)."""
        core.check_id(replica_id)
        endpoints = core.check_ranks(world_size, ranks)
        self._ensure_open()
        self._check_admission(replica_id, world_size, endpoints)
        incarnation = await self._store.next_incarnation(replica_id)
        self._ensure_open()
        self._check_admission(replica_id, world_size, endpoints)  # the store may have suspended
        now = self._clock()
        reg = Registration(
            replica_id=replica_id, incarnation=incarnation, world_size=world_size, ranks=endpoints
        )
        old = self._state.register(reg, now)
        if old is not None:
            self._after_removal(
                old,
                kind="evicted",
                cause="superseded",
                reason=(f"superseded by incarnation {incarnation}"),
            )
        self._persist(self._store.put_member, reg)
        self._metrics.joins.inc()
        self._metrics.members.set(len(self._state.registered))
        log.info(
            "replica joined",
            extra={"replica_id": replica_id, "incarnation": incarnation, "world_size": world_size},
        )
        self._emit("joined", replica_id, f"incarnation {incarnation}", incarnation=incarnation)
        self._evaluate(now)
        return incarnation, self._state.last_quorum_id

    async def quorum(self, ask: QuorumAsk) -> Formation:
        """Waits until a quorum including the caller forms (the caller's deadline bounds it)."""
        core.check_step(ask.step)
        self._ensure_open()
        self._state.check(ask.replica_id, ask.incarnation)
        cached = self._answered.get(ask.replica_id)
        if ask.attempt_id and cached and cached[:2] == (ask.incarnation, ask.attempt_id):
            return cached[2]  # the answer to this very call was lost on the way: same answer
        now = self._clock()
        rid = ask.replica_id
        previous = self._waiters.pop(rid, None)
        if previous is not None and not previous.future.done():
            previous.future.set_exception(
                SupersededRequestError(f"a newer Quorum call of {rid} replaced this one")
            )
        waiter = Waiter(ask, asyncio.get_running_loop().create_future(), now)
        self._waiters[rid] = waiter
        self._state.add_ask(
            Ask(
                replica_id=rid,
                incarnation=ask.incarnation,
                step=ask.step,
                commit_failed=ask.commit_failed,
                arrived=now,
                work=ask.work,
            )
        )
        if not ask.commit_failed:  # a retry repeats its last committed step's measure
            self._failslow.observe(rid, ask.incarnation, ask.work)
        self._evaluate(now)
        try:
            return await waiter.future
        finally:
            self._settle(waiter)

    def heartbeat(self, replica_id: str, incarnation: int) -> int:
        """Records a sign of life; returns the latest quorum id."""
        self._ensure_open()
        self._state.check(replica_id, incarnation)
        self._state.touch(replica_id, self._clock())
        return self._state.last_quorum_id

    def report_failure(
        self,
        replica_id: str,
        incarnation: int | None,
        reason: str,
        reporter: str,
        *,
        teardown: bool = False,
        unless_heard_within: float | None = None,
    ) -> bool:
        """Evicts a replica at once; False when it was already gone or the report is stale.
        `teardown` travels on the eviction event: the replica's ranks exit and node agents
        kill its processes. With `unless_heard_within` (seconds), also False while the replica
        called within that long or within three of its usual intervals between Quorum calls
        (`CoreState.silent_for`): the reporter may only have lost its own link to it."""
        core.check_id(replica_id)
        core.check_id(reporter, "reporter")
        core.check_reason(reason)
        self._ensure_open()
        if replica_id not in self._state.issued:
            raise UnknownReplicaError(f"unknown replica: {replica_id} never joined")
        reg = self._state.registered.get(replica_id)
        if reg is None or (incarnation is not None and incarnation != reg.incarnation):
            return False
        if unless_heard_within is not None:
            quiet = max(unless_heard_within, 3 * self._state.ask_gap.get(replica_id, 0.0))
            if self._state.silent_for(replica_id, self._clock()) < quiet:
                return False
        self._evict(
            reg, kind="evicted", cause="report", reason=f"{reporter}: {reason}", teardown=teardown
        )
        return True

    def leave(self, replica_id: str, incarnation: int, reason: str) -> None:
        """Removes a replica gracefully."""
        core.check_reason(reason)
        self._ensure_open()
        reg = self._state.check(replica_id, incarnation)
        self._evict(reg, kind="left", cause="left", reason=reason or "left")

    async def status(self, history_limit: int = 0) -> StatusSnapshot:
        """Membership with liveness, and recent quorums."""
        hb = self._config.heartbeat_timeout.total_seconds()
        members = status.members_status(self._state, self._clock(), hb)
        try:
            records = await self._store.history(history_limit)
        except NotLeaderError:
            raise
        except Exception as exc:  # the history lives in the store: a client may ask another
            raise StoreUnavailableError(f"cannot read the quorum history: {exc}") from exc
        return status.snapshot(self._state, members, records, self._failslow.decisions)

    def subscribe(
        self,
        holder: tuple[str, int] | None = None,
        *,
        without_joins: bool = False,
        replicas: frozenset[str] | None = None,
    ) -> Subscription:
        """A new event stream; its first event is a `snapshot` of the current membership. With
        `holder` (replica id, incarnation: the stream of that replica's leader), the replica
        counts as alive until `unsubscribe`, and the snapshot names that incarnation; a holder
        that is not a current incarnation gets a plain stream (its events still matter to it),
        and a snapshot without one. `without_joins`: no `joined` events. `replicas`: only events
        about these, no `quorum` events, and a snapshot of those registered with their
        incarnations."""
        self._ensure_open()
        if holder is not None:
            try:
                self._state.hold(*holder)
            except (StaleIncarnationError, UnknownReplicaError):
                holder = None
        snapshot = self._event("snapshot", None, "current state")
        if holder is not None:
            snapshot = dataclasses.replace(snapshot, incarnation=holder[1])
        if replicas is not None:
            regs = [self._state.registered.get(rid) for rid in sorted(replicas)]
            snapshot = dataclasses.replace(
                snapshot,
                members=tuple(r.replica_id for r in regs if r is not None),
                incarnations=tuple(r.incarnation for r in regs if r is not None),
            )
        sub = self._events.subscribe(snapshot, without_joins=without_joins, replicas=replicas)
        sub.holder = holder
        return sub

    @property
    def watch_streams(self) -> int:
        """Watch streams open on this coordinator."""
        return self._events.streams

    def unsubscribe(self, sub: Subscription) -> None:
        """Ends delivery to a stream (and its hold: the heartbeat timeout runs from now)."""
        self._events.unsubscribe(sub)
        if sub.holder is not None:
            self._state.release(*sub.holder, self._clock())
            sub.holder = None

    def poll(self) -> None:
        """Evicts expired replicas and re-evaluates the round (timers call it; tests too)."""
        if self._closing:
            return
        now = self._clock()
        gone, _ = core.expired(now, self._state, self._config)
        for rid in gone:
            reg = self._state.registered[rid]
            timeout_ms = int(self._config.heartbeat_timeout.total_seconds() * 1000)
            self._evict(
                reg, kind="evicted", cause="heartbeat", reason=(f"no heartbeat for {timeout_ms} ms")
            )
        self._evaluate(now)

    # ---- rounds -------------------------------------------------------------------------------

    def _evaluate(self, now: float) -> None:
        if self._closing:
            return
        decision, reason = core.decide(now, self._state, self._config)
        if decision.form:
            self._form(now, decision.path, reason)
        else:
            self._arm_timer(decision.wake_at)

    def _form(self, now: float, path: str, reason: str) -> None:
        shares = None
        if self._failslow.policy != "off":
            shares, evict = self._failslow.plan_round(self._state, now)
            if evict:  # each eviction re-evaluates the round without the evicted replica
                for rid in evict:
                    self._evict(
                        self._state.registered[rid],
                        kind="evicted",
                        cause="failslow",
                        reason="fail-slow: " + self._failslow.decisions[-1].reason,
                        teardown=True,
                    )
                return
        formation = core.form(
            now, self._state, reason=reason, formed_unix=self._wall(), next_shares=shares
        )
        waiters = [self._waiters.pop(a.replica_id) for a in formation.participants]
        new_epoch = formation.record.quorum_id != self._state.last_quorum_id
        slow_before = self._state.slow_catchup
        self._state.apply(formation, now)
        for rid in sorted(self._state.slow_catchup - slow_before):
            log.warning(
                "replica %s is catching up again: its last catch-up outlasted the join timeout "
                "(%.1f s) and the round went on without it; the next round waits for it up to "
                "the catch-up timeout (%.0f s). A state this slow to fetch and load wants a "
                "longer --join-timeout-ms",
                rid,
                self._config.join_timeout.total_seconds(),
                self._config.catchup_timeout.total_seconds(),
                extra={"replica_id": rid},
            )
        self._cancel_timer()
        tally = Tally(formation.record.round, now, len(waiters))
        for waiter in waiters:
            waiter.tally = tally
        self._metrics.rounds.labels(path=path).inc()
        if new_epoch:
            self._metrics.epochs.inc()
            self._metrics.quorum_id.set(formation.record.quorum_id)
            log.info(
                "new quorum",
                extra={
                    "quorum_id": formation.record.quorum_id,
                    "members": len(waiters),
                    "max_step": formation.quorum.max_step,
                    "reason": reason,
                },
            )
        self._spawn(self._publish(formation, waiters, new_epoch))

    async def _publish(self, formation: Formation, waiters: list[Waiter], new_epoch: bool) -> None:
        """Persists the round, then answers. A new epoch is answered only once persisted (I3:
        never an id the store could lose); a round that keeps the epoch and the membership is
        answered even when the store is down (it decides nothing a later leader could
        contradict), so training goes on through a store outage."""
        quorum_id = formation.record.quorum_id
        must_persist = new_epoch or quorum_id == self._unsaved
        try:
            async with self._store_lock:
                await self._store.save_quorum(formation.record)
        except NotLeaderError as exc:  # fenced: the callers must fail over
            self._fail_waiters(waiters, exc)
            return
        except Exception as exc:
            if must_persist:
                self._unsaved = quorum_id
                log.warning("could not persist new quorum %d: %s", quorum_id, exc)
                self._fail_waiters(
                    waiters, StoreUnavailableError(f"cannot persist quorum {quorum_id}: {exc}")
                )
                return
            if not self._store_down_logged:
                log.warning("store unavailable; answering quorum %d unpersisted", quorum_id)
                self._store_down_logged = True
        else:
            self._store_down_logged = False
            if quorum_id == self._unsaved:
                self._unsaved = None
        for waiter in waiters:
            if waiter.ask.attempt_id:
                self._answered[waiter.ask.replica_id] = (
                    waiter.ask.incarnation,
                    waiter.ask.attempt_id,
                    formation,
                )
            if not waiter.future.done():
                waiter.future.set_result(formation)
        if must_persist:  # the first answer with this id
            self._emit("quorum", None, formation.quorum.reason, formation.quorum)

    @staticmethod
    def _fail_waiters(waiters: list[Waiter], error: BaseException) -> None:
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(error)

    def _settle(self, waiter: Waiter) -> None:
        """After a Quorum call ends: drop it from the round if it never formed (cancelled RPC),
        and account the round's latency once its last participant is answered."""
        now = self._clock()
        rid = waiter.ask.replica_id
        if self._waiters.get(rid) is waiter:
            del self._waiters[rid]
            self._state.drop_ask(rid)
            self._state.touch(rid, now)
            log.info("dropped a cancelled quorum request", extra={"replica_id": rid})
            self._evaluate(now)
        self._metrics.wait_seconds.observe(now - waiter.arrived)
        tally = waiter.tally
        if tally is not None:
            tally.pending -= 1
            if tally.pending == 0:
                seconds = max(0.0, now - tally.started)
                self._metrics.round_seconds.observe(seconds)
                self.round_timings.append(
                    RoundTiming(round=tally.round, participants=tally.size, seconds=seconds)
                )

    def _arm_timer(self, wake_at: float | None) -> None:
        if wake_at == self._timer_at and self._timer is not None:
            return
        self._cancel_timer()
        if wake_at is None:
            return
        delay = max(0.0, wake_at - self._clock()) + _TIMER_SLACK
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
        self._timer_at = wake_at

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.poll()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_at = None

    async def _sweep_forever(self) -> None:
        """Evicts replicas at their heartbeat expiry. Expiries only move later (signs of life
        only ever raise last_seen, new replicas expire a full timeout from now), so sleeping
        until the earliest known one never misses one."""
        idle = self._config.heartbeat_timeout.total_seconds()
        while True:
            self.poll()
            _, next_expiry = core.expired(self._clock(), self._state, self._config)
            delay = idle if next_expiry is None else next_expiry - self._clock() + _TIMER_SLACK
            await asyncio.sleep(max(_TIMER_SLACK, delay))

    # ---- membership ---------------------------------------------------------------------------

    def _evict(
        self,
        reg: Registration,
        *,
        kind: EventKind,
        cause: str,
        reason: str,
        teardown: bool = False,
    ) -> None:
        self._state.remove(reg.replica_id)
        self._after_removal(reg, kind=kind, cause=cause, reason=reason, teardown=teardown)
        self._persist(self._store.remove_member, reg.replica_id, reg.incarnation)
        self._metrics.members.set(len(self._state.registered))
        self._evaluate(self._clock())

    def _after_removal(
        self,
        reg: Registration,
        *,
        kind: EventKind,
        cause: str,
        reason: str,
        teardown: bool = False,
    ) -> None:
        """Fails the removed incarnation's pending call and tells the watchers."""
        rid = reg.replica_id
        waiter = self._waiters.get(rid)
        if waiter is not None and waiter.ask.incarnation == reg.incarnation:
            del self._waiters[rid]
            if not waiter.future.done():
                waiter.future.set_exception(
                    StaleIncarnationError(
                        f"stale incarnation: {rid} incarnation {reg.incarnation} "
                        f"was removed: {reason}"
                    )
                )
        self._answered.pop(rid, None)
        self._metrics.evictions.labels(cause=cause).inc()
        log.warning(
            "replica removed",
            extra={
                "replica_id": rid,
                "incarnation": reg.incarnation,
                "cause": cause,
                "reason": reason,
                "teardown": teardown,
            },
        )
        self._emit(kind, rid, reason, incarnation=reg.incarnation, teardown=teardown)

    def _check_admission(
        self, replica_id: str, world_size: int, endpoints: Sequence[RankEndpoint]
    ) -> None:
        self._check_world_size(replica_id, world_size)
        # Every answer listing the membership must still fit in one message, or a round forms
        # and nobody learns it (a rejoin replaces its own share).
        state = self._state
        total = (
            core.membership_bytes(endpoints)
            + state.membership_bytes
            - state.member_bytes.get(replica_id, 0)
        )
        if total > core.MAX_MEMBERSHIP_BYTES:
            raise MembershipTooLargeError(
                f"admitting {replica_id} would bring the members' endpoints to {total} bytes, "
                f"over the {core.MAX_MEMBERSHIP_BYTES} that one answer can carry: use shorter "
                "addresses or fewer ranks per replica"
            )

    def _check_world_size(self, replica_id: str, world_size: int) -> None:
        other = next(
            (r for r in self._state.registered.values() if r.replica_id != replica_id), None
        )
        if other is not None and other.world_size != world_size:
            raise WorldSizeMismatchError(
                f"world_size {world_size} differs from the members' {other.world_size} "
                f"(e.g. {other.replica_id}): every replica of a job must have the same world size"
            )

    def _ensure_open(self) -> None:
        if self._closing:
            raise ShuttingDownError("the quorum service is stopping")

    # ---- events and background writes ---------------------------------------------------------

    def _event(
        self,
        kind: EventKind,
        replica_id: str | None,
        reason: str,
        quorum: Any = None,
        *,
        incarnation: int | None = None,
        teardown: bool = False,
    ) -> MembershipEvent:
        if quorum is not None:
            members = tuple(m.replica_id for m in quorum.members)
        elif kind == "snapshot":
            members = tuple(sorted(self._state.registered))
        else:
            members = ()
        return MembershipEvent(
            kind=kind,
            replica_id=replica_id,
            quorum_id=self._state.last_quorum_id,
            reason=reason,
            members=members,
            incarnation=incarnation,
            teardown=teardown,
        )

    def _emit(
        self,
        kind: EventKind,
        replica_id: str | None,
        reason: str,
        quorum: Any = None,
        *,
        incarnation: int | None = None,
        teardown: bool = False,
    ) -> None:
        if self._events.active:
            self._events.publish(
                self._event(
                    kind, replica_id, reason, quorum, incarnation=incarnation, teardown=teardown
                )
            )

    def _persist(self, write: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Writes membership through to the store in order, off the caller's path."""

        async def run() -> None:
            try:
                async with self._store_lock:
                    await write(*args)
            except Exception:
                log.exception("store write failed")

        self._spawn(run())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
