"""Clients of the quorum service: `QuorumClient` (blocking, thread-safe) and `AsyncQuorumClient`.

They hide gRPC: callers get domain objects (`Quorum`, `MembershipEvent`, `StatusSnapshot`) and
typed errors rooted in `QuorumError` (`QuorumTimeoutError` is also a `TimeoutError`). Every RPC has
a deadline; UNAVAILABLE (service down, restarting, draining) is retried with exponential backoff
and full jitter within an overall budget.

`quorum()` is retry-safe: each logical call carries a random `attempt_id`, reused by its
transport retries, so a retry after a lost answer gets that same answer, and a retry of a call
still waiting simply takes its place in the round. Members' rank endpoints travel only when the
quorum id changes; the client caches them by quorum id and always returns complete members."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Collection, Sequence
from datetime import timedelta
from typing import Any

import grpc

from fthsdp.protos import quorum_pb2 as pb
from fthsdp.protos import quorum_pb2_grpc as pb_grpc
from fthsdp.services.common.backoff import Backoff
from fthsdp.services.common.tokens import Token
from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.client_failover import Failover, parse_addresses
from fthsdp.services.quorum.client_retry import CallRetry
from fthsdp.services.quorum.client_watch import AsyncWatchStream, WatchStream, translate
from fthsdp.services.quorum.domain import (
    MAX_WATCHED_REPLICAS,
    AuthError,
    EventKind,
    InternalError,
    InvalidRequestError,
    Member,
    MembershipEvent,
    MembershipTooLargeError,
    MemberStatus,
    MicroSteps,
    Quorum,
    QuorumError,
    QuorumSummary,
    QuorumTimeoutError,
    QuorumUnavailableError,
    RankEndpoint,
    StaleIncarnationError,
    StatusSnapshot,
    StepWork,
    SupersededRequestError,
    UnknownReplicaError,
    WorldSizeMismatchError,
)

__all__ = [
    "MAX_WATCHED_REPLICAS",
    "AsyncQuorumClient",
    "AsyncWatchStream",
    "AuthError",
    "EventKind",
    "InternalError",
    "InvalidRequestError",
    "Member",
    "MemberStatus",
    "MembershipEvent",
    "MembershipTooLargeError",
    "MicroSteps",
    "Quorum",
    "QuorumClient",
    "QuorumDecodeCache",
    "QuorumError",
    "QuorumSummary",
    "QuorumTimeoutError",
    "QuorumUnavailableError",
    "RankEndpoint",
    "StaleIncarnationError",
    "StatusSnapshot",
    "StepWork",
    "SupersededRequestError",
    "UnknownReplicaError",
    "WatchStream",
    "WorldSizeMismatchError",
]

DEFAULT_RPC_TIMEOUT = timedelta(seconds=5)
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=30)
DEFAULT_BACKOFF = Backoff(maximum=timedelta(milliseconds=500))
"""Retries of one service stay frequent (at most 0.5 s apart): a failover to a standby takes
about one lease, and heartbeats must reach the new leader within its grace."""
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    # Notice a dead service during a call: a blackholed leader (packets dropped, nothing
    # refused) fails the call as UNAVAILABLE within ~2 s, and the client moves to the standby
    # instead of waiting out the call's deadline. Pings go only while a call is open.
    ("grpc.keepalive_time_ms", 1_000),
    ("grpc.keepalive_timeout_ms", 1_000),
    # Reconnect quickly after a service restart; our own Backoff spaces the calls.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]


_STALE_LEADER = "answer from a deposed quorum leader (older lease epoch); asking another instance"


def _refusal(err: grpc.RpcError) -> QuorumUnavailableError:
    """The UNAVAILABLE error to retry on; raises any other error, which ends the call."""
    error = translate(err)
    if not isinstance(error, QuorumUnavailableError):
        raise error from None
    return error


def _new_attempt_id() -> int:
    # Not the module-level generator: it is the user's, and travels with a replica's state.
    return secrets.randbits(63) | 1


def _seconds(value: timedelta) -> float:
    return value.total_seconds()


class QuorumDecodeCache:
    """What a client holds between its Quorum calls (thread-safe): the latest quorum seen (its
    id is the `known_quorum_id` of the next request, so a steady answer leaves the members out),
    the endpoints each caller received, and the last few decoded answers.

    One per client by default. Clients in one process may share one (`decode_cache=`), e.g. when
    a process emulates many replicas: every participant of a round gets the same shared part, so
    it is decoded once per round per process instead of once per client; each caller's
    endpoints are kept apart."""

    _MEMO_SIZE = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: Quorum | None = None
        self._memo: dict[tuple[object, ...], Quorum] = {}
        self._held: dict[str, tuple[int, dict[str, tuple[int, tuple[RankEndpoint, ...]]]]] = {}
        """Caller -> (the quorum id of its last answer, the endpoints it holds)."""

    def known_quorum_id(self, replica_id: str) -> int:
        """The quorum id whose members and endpoints this cache holds for `replica_id` (0:
        none)."""
        with self._lock:
            held = self._held.get(replica_id)
            known = self._known
            if held is None or known is None or known.quorum_id != held[0]:
                return 0
            return held[0]

    def decode(self, msg: pb.QuorumResponse, replica_id: str) -> Quorum | None:
        """The quorum as `replica_id` needs it (`Quorum.needed_by` with endpoints), or None when
        the message builds on members or endpoints this cache does not hold (another client
        sharing it moved it on): ask again without."""
        key = _memo_key(msg)
        received = codec.endpoints_from_pb(msg)
        with self._lock:
            held = self._held.get(replica_id)
            if msg.members_form == codec.SAME and (held is None or held[0] != msg.quorum_id):
                return None
            quorum = self._memo.get(key)
            if quorum is None:
                try:
                    quorum = codec.quorum_from_pb(msg, self._known)
                except KeyError:
                    return None
                if self._known is None or quorum.quorum_id >= self._known.quorum_id:
                    self._known = quorum
                if len(self._memo) >= self._MEMO_SIZE:
                    self._memo.clear()
                self._memo[key] = quorum
            if not quorum.is_member(replica_id):
                raise InternalError(f"an answer to {replica_id} that leaves it out")
            kept = {} if held is None else held[1]
            mine = {}
            for rid in quorum.needed_by(replica_id):
                endpoints = received.get(rid) or kept.get(rid)
                if endpoints is None or endpoints[0] != quorum.member(rid).incarnation:
                    return None  # the service took us for holding what we do not
                mine[rid] = endpoints
            self._held[replica_id] = (msg.quorum_id, mine)
            return codec.with_endpoints(quorum, mine)


def _memo_key(msg: pb.QuorumResponse) -> tuple[object, ...]:
    """What tells the shared parts of two answers apart, without re-serializing one of a
    thousand members: a quorum id names one membership with its incarnations (I3); the steps
    and sources are what moves within it."""
    return (
        msg.quorum_id,
        msg.max_step,
        msg.members_form,
        msg.reason,
        tuple((m.replica_id, m.step) for m in msg.members),
        tuple((m.replica_id, m.step) for m in msg.lagging),
        tuple((a.replica_id, tuple(a.first_source)) for a in msg.recovering),
        tuple((s.replica_id, s.trained, s.next) for s in msg.uneven),
        msg.even_micro_steps,
    )


def _watch_request(
    holder: tuple[str, int] | None, without_joins: bool, replicas: Collection[str] | None
) -> pb.WatchRequest:
    replica_id, incarnation = holder if holder is not None else ("", 0)
    return pb.WatchRequest(
        replica_id=replica_id,
        incarnation=incarnation,
        without_joins=without_joins,
        replica_ids=sorted(replicas or ()),
    )


def _join_request(replica_id: str, ranks: Sequence[RankEndpoint]) -> pb.JoinRequest:
    return pb.JoinRequest(
        replica_id=replica_id, world_size=len(ranks), ranks=codec.ranks_to_pb(ranks)
    )


def _quorum_request(
    replica_id: str,
    incarnation: int,
    step: int,
    commit_failed: bool,
    known: int,
    attempt: int,
    work: StepWork | None,
) -> pb.QuorumRequest:
    request = pb.QuorumRequest(
        replica_id=replica_id,
        incarnation=incarnation,
        step=step,
        commit_failed=commit_failed,
        known_quorum_id=known,
        attempt_id=attempt,
    )
    if work is not None:
        codec.work_to_pb(request, work)
    return request


def _report_request(
    replica_id: str,
    reason: str,
    reporter: str,
    incarnation: int | None,
    teardown: bool,
    unless_heard_within: timedelta | None,
) -> pb.ReportFailureRequest:
    request = pb.ReportFailureRequest(
        replica_id=replica_id, reason=reason, reporter=reporter, teardown=teardown
    )
    if unless_heard_within is not None:
        request.unless_heard_within_ms = max(1, int(unless_heard_within.total_seconds() * 1000))
    if incarnation is not None:
        request.incarnation = incarnation
    return request


class _ClientSettings:
    """What both clients share: credentials, timeouts, the failover and the retry rule."""

    def __init__(
        self,
        addresses: Sequence[str],
        token: str | Token,
        rpc_timeout: timedelta,
        connect_timeout: timedelta,
        backoff: Backoff | None,
        decode_cache: QuorumDecodeCache | None,
    ) -> None:
        if rpc_timeout <= timedelta(0) or connect_timeout < timedelta(0):
            raise ValueError("rpc_timeout must be positive and connect_timeout not negative")
        secret = token if isinstance(token, Token) else Token(token)
        self._metadata = (("authorization", secret.header()),)
        self._rpc_timeout = _seconds(rpc_timeout)
        self._connect_timeout = _seconds(connect_timeout)
        self._backoff = backoff or DEFAULT_BACKOFF
        self._failover = Failover(addresses)
        self._endpoints = decode_cache or QuorumDecodeCache()

    def _retry(self, deadline: float | None, unavailable_budget: float | None) -> CallRetry:
        return CallRetry(
            self._failover,
            self._backoff.delays(),
            now=time.monotonic(),
            rpc_timeout=self._rpc_timeout,
            connect_timeout=self._connect_timeout,
            deadline=deadline,
            unavailable_budget=unavailable_budget,
        )


# ---- blocking client ------------------------------------------------------------------------


class QuorumClient(_ClientSettings):
    """Blocking client of the quorum service; safe to share between threads."""

    def __init__(
        self,
        address: str | Sequence[str],
        token: str | Token,
        *,
        rpc_timeout: timedelta = DEFAULT_RPC_TIMEOUT,
        connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
        backoff: Backoff | None = None,
        decode_cache: QuorumDecodeCache | None = None,
    ) -> None:
        """`address`: `host:port`, or every instance of a leader/standby setup (a sequence or a
        comma-separated string; see `client_failover`). `rpc_timeout` bounds one attempt of a
        short RPC; `connect_timeout` bounds how long a call keeps retrying while the service is
        unavailable."""
        super().__init__(
            parse_addresses(address), token, rpc_timeout, connect_timeout, backoff, decode_cache
        )
        self._channels = [
            grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self._failover.addresses
        ]
        self._stubs = [pb_grpc.QuorumServiceStub(c) for c in self._channels]
        self._streams: set[WatchStream] = set()
        self._lock = threading.Lock()
        self._closed = False

    def join(self, replica_id: str, ranks: Sequence[RankEndpoint]) -> int:
        """Registers this process start of the replica; returns its new incarnation."""
        response = self._call("Join", _join_request(replica_id, ranks))
        return int(response.incarnation)

    def quorum(
        self,
        replica_id: str,
        incarnation: int,
        step: int,
        *,
        commit_failed: bool = False,
        timeout: timedelta,
        unavailable_budget: timedelta | None = None,
        work: StepWork | None = None,
    ) -> Quorum:
        """Waits until a quorum that includes this replica forms; QuorumTimeoutError after
        `timeout`. With `unavailable_budget`, QuorumUnavailableError as soon as every instance
        of the service refused and none has answered for that long (the caller may go on
        without it; a zero budget tries each instance once). `work` tells the fail-slow
        planner this replica's micro-steps and speed (see `StepWork`)."""
        deadline = time.monotonic() + _seconds(timeout)
        attempt = _new_attempt_id()
        known = self._endpoints.known_quorum_id(replica_id)
        budget = None if unavailable_budget is None else _seconds(unavailable_budget)
        while True:
            request = _quorum_request(
                replica_id, incarnation, step, commit_failed, known, attempt, work
            )
            response = self._call("Quorum", request, deadline=deadline, unavailable_budget=budget)
            quorum = self._endpoints.decode(response, replica_id)
            if quorum is not None:
                return quorum
            known = 0  # our cache moved on meanwhile: the same attempt again, with endpoints

    def heartbeat(self, replica_id: str, incarnation: int) -> None:
        """Tells the service the replica is alive."""
        self._call(
            "Heartbeat",
            pb.HeartbeatRequest(replica_id=replica_id, incarnation=incarnation),
        )

    def report_failure(
        self,
        replica_id: str,
        reason: str,
        *,
        reporter: str,
        incarnation: int | None = None,
        teardown: bool = False,
        unless_heard_within: timedelta | None = None,
    ) -> bool:
        """Evicts a replica at once; True if this report evicted it (False: already gone, or
        heard from within `unless_heard_within`, see ReportFailureRequest). `teardown`: its
        ranks are to exit and its processes be killed (a rank is dead or hung)."""
        request = _report_request(
            replica_id, reason, reporter, incarnation, teardown, unless_heard_within
        )
        return bool(self._call("ReportFailure", request).evicted)

    def leave(self, replica_id: str, incarnation: int, reason: str = "") -> None:
        """Leaves gracefully."""
        request = pb.LeaveRequest(replica_id=replica_id, incarnation=incarnation, reason=reason)
        self._call("Leave", request)

    def status(self, history_limit: int = 0) -> StatusSnapshot:
        """Membership with liveness, and recent quorums (all kept when `history_limit` is 0)."""
        response = self._call("Status", pb.StatusRequest(history_limit=history_limit))
        return codec.status_from_pb(response)

    def watch(
        self,
        *,
        timeout: timedelta | None = None,
        holder: tuple[str, int] | None = None,
        without_joins: bool = False,
        replicas: Collection[str] | None = None,
    ) -> WatchStream:
        """Membership events, the first being a `snapshot`; blocks between events. End it with
        `cancel()` on the stream or `close()` on the client, from any thread. `holder`: the
        replica (and incarnation) whose leader opens it, kept alive without heartbeats while
        the stream is open. `without_joins`: no `joined` events (a leader's stream).
        `replicas` (at most `MAX_WATCHED_REPLICAS`): only events about these, no `quorum`
        events, and a snapshot of those registered with their incarnations (a node agent's)."""
        index = self._failover.current
        call = self._stubs[index].Watch(
            _watch_request(holder, without_joins, replicas),
            metadata=self._metadata,
            timeout=None if timeout is None else _seconds(timeout),
        )
        stream = WatchStream(call, self._forget, lambda: self._failover.advance(index))
        with self._lock:
            if self._closed:
                stream.cancel()
            self._streams.add(stream)
        return stream

    def close(self) -> None:
        """Cancels open Watch streams and closes the channel. Idempotent."""
        with self._lock:
            self._closed = True
            streams = list(self._streams)
            self._streams.clear()
        for stream in streams:
            stream.cancel()
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> QuorumClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget(self, stream: WatchStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def _call(
        self,
        method: str,
        request: Any,
        *,
        deadline: float | None = None,
        unavailable_budget: float | None = None,
    ) -> Any:
        """One RPC, retried on refusals by `CallRetry`'s rule."""
        retry = self._retry(deadline, unavailable_budget)
        while True:
            attempt = retry.attempt(time.monotonic())
            stub_method = getattr(self._stubs[attempt.index], method)
            try:
                response = stub_method(request, timeout=attempt.timeout, metadata=self._metadata)
            except grpc.RpcError as err:
                refusal = _refusal(err)
            else:
                if self._failover.accept(response):
                    return response
                refusal = QuorumUnavailableError(_STALE_LEADER)
            time.sleep(retry.refused(attempt, refusal, time.monotonic()))


# ---- asyncio client -------------------------------------------------------------------------


class AsyncQuorumClient(_ClientSettings):
    """asyncio client of the quorum service (one event loop); same API as `QuorumClient`."""

    def __init__(
        self,
        address: str | Sequence[str],
        token: str | Token,
        *,
        rpc_timeout: timedelta = DEFAULT_RPC_TIMEOUT,
        connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT,
        backoff: Backoff | None = None,
        channel: grpc.aio.Channel | None = None,
        decode_cache: QuorumDecodeCache | None = None,
    ) -> None:
        """`channel` lets many clients share one connection (benchmarks); it is then not closed
        by `close()`, and it is the only instance asked (`address` must name one)."""
        addresses = parse_addresses(address)
        if channel is not None and len(addresses) != 1:
            raise ValueError("with a shared channel, give the one address it connects to")
        super().__init__(addresses, token, rpc_timeout, connect_timeout, backoff, decode_cache)
        self._owns_channel = channel is None
        self._channels = (
            [channel]
            if channel is not None
            else [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
        )
        self._stubs = [pb_grpc.QuorumServiceStub(c) for c in self._channels]
        self._streams: set[AsyncWatchStream] = set()

    async def join(self, replica_id: str, ranks: Sequence[RankEndpoint]) -> int:
        """Registers this process start of the replica; returns its new incarnation."""
        response = await self._call("Join", _join_request(replica_id, ranks))
        return int(response.incarnation)

    async def quorum(
        self,
        replica_id: str,
        incarnation: int,
        step: int,
        *,
        commit_failed: bool = False,
        timeout: timedelta,
        unavailable_budget: timedelta | None = None,
        work: StepWork | None = None,
    ) -> Quorum:
        """Waits until a quorum that includes this replica forms; QuorumTimeoutError after
        `timeout`. `unavailable_budget` as in `QuorumClient.quorum`."""
        deadline = time.monotonic() + _seconds(timeout)
        attempt = _new_attempt_id()
        known = self._endpoints.known_quorum_id(replica_id)
        budget = None if unavailable_budget is None else _seconds(unavailable_budget)
        while True:
            request = _quorum_request(
                replica_id, incarnation, step, commit_failed, known, attempt, work
            )
            response = await self._call(
                "Quorum", request, deadline=deadline, unavailable_budget=budget
            )
            quorum = self._endpoints.decode(response, replica_id)
            if quorum is not None:
                return quorum
            known = 0

    async def heartbeat(self, replica_id: str, incarnation: int) -> None:
        """Tells the service the replica is alive."""
        await self._call(
            "Heartbeat",
            pb.HeartbeatRequest(replica_id=replica_id, incarnation=incarnation),
        )

    async def report_failure(
        self,
        replica_id: str,
        reason: str,
        *,
        reporter: str,
        incarnation: int | None = None,
        teardown: bool = False,
        unless_heard_within: timedelta | None = None,
    ) -> bool:
        """Evicts a replica at once; True if this report evicted it (False: already gone, or
        heard from within `unless_heard_within`, see ReportFailureRequest). `teardown`: its
        ranks are to exit and its processes be killed (a rank is dead or hung)."""
        request = _report_request(
            replica_id, reason, reporter, incarnation, teardown, unless_heard_within
        )
        return bool((await self._call("ReportFailure", request)).evicted)

    async def leave(self, replica_id: str, incarnation: int, reason: str = "") -> None:
        """Leaves gracefully."""
        request = pb.LeaveRequest(replica_id=replica_id, incarnation=incarnation, reason=reason)
        await self._call("Leave", request)

    async def status(self, history_limit: int = 0) -> StatusSnapshot:
        """Membership with liveness, and recent quorums."""
        response = await self._call("Status", pb.StatusRequest(history_limit=history_limit))
        return codec.status_from_pb(response)

    def watch(
        self,
        *,
        timeout: timedelta | None = None,
        holder: tuple[str, int] | None = None,
        without_joins: bool = False,
        replicas: Collection[str] | None = None,
    ) -> AsyncWatchStream:
        """Membership events, the first being a `snapshot`; end it with `cancel()` or `close()`.
        `holder`, `without_joins` and `replicas` as in `QuorumClient.watch`."""
        index = self._failover.current
        call = self._stubs[index].Watch(
            _watch_request(holder, without_joins, replicas),
            metadata=self._metadata,
            timeout=None if timeout is None else _seconds(timeout),
        )
        stream = AsyncWatchStream(
            call, lambda: self._failover.advance(index), self._streams.discard
        )
        self._streams.add(stream)
        return stream

    async def close(self) -> None:
        """Cancels open Watch streams and closes the channel (if this client owns it)."""
        for stream in list(self._streams):
            stream.cancel()
        self._streams.clear()
        if self._owns_channel:
            for channel in self._channels:
                await channel.close(None)

    async def __aenter__(self) -> AsyncQuorumClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: str,
        request: Any,
        *,
        deadline: float | None = None,
        unavailable_budget: float | None = None,
    ) -> Any:
        """One RPC, retried on refusals by `CallRetry`'s rule (the blocking client's)."""
        retry = self._retry(deadline, unavailable_budget)
        while True:
            attempt = retry.attempt(time.monotonic())
            stub_method = getattr(self._stubs[attempt.index], method)
            try:
                response = await stub_method(
                    request, timeout=attempt.timeout, metadata=self._metadata
                )
            except grpc.RpcError as err:
                refusal = _refusal(err)
            else:
                if self._failover.accept(response):
                    return response
                refusal = QuorumUnavailableError(_STALE_LEADER)
            await asyncio.sleep(retry.refused(attempt, refusal, time.monotonic()))
