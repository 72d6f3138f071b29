"""The health service's side of the quorum service: failure reports and history reads, through
the quorum service's public client only.

Reports try the addresses in order (primary first, then standbys) with a short deadline each, so
a dead primary delays a report by one deadline, not by the client's whole retry budget. A replica
reported within the last `dedupe` seconds is not reported again: when a whole replica dies, every
one of its ranks falls silent in the same check, and one report evicts them all."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from datetime import timedelta
from typing import Literal

from fthsdp.services.common.backoff import Backoff, Retries
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.domain import UpstreamError
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.quorum.client import (
    AsyncQuorumClient,
    MembershipEvent,
    QuorumError,
    QuorumUnavailableError,
    StatusSnapshot,
    UnknownReplicaError,
)

log = logging.getLogger(__name__)

WATCH_RETRY = Backoff(initial=timedelta(milliseconds=200), maximum=timedelta(seconds=5))
"""Between a node agent's event streams (the service restarting or failing over, a refused
stream): jittered, and growing, so that 12K agents do not all come back every 0.2 s at once."""
_sleep = asyncio.sleep  # the wait between streams (tests record it)

Outcome = Literal["evicted", "already_gone", "unknown_replica", "failed", "deduplicated"]


class QuorumReporter:
    """Reports failures to, and reads history from, the quorum service (asyncio, one loop)."""

    def __init__(
        self,
        addresses: Sequence[str],
        token: Token,
        *,
        timeout: timedelta = timedelta(seconds=1),
        metrics: HealthMetrics | None = None,
        dedupe: timedelta = timedelta(seconds=1),
    ) -> None:
        if not addresses:
            raise ValueError("QuorumReporter needs at least one address")
        self._clients = [
            AsyncQuorumClient(address, token, rpc_timeout=timeout, connect_timeout=timedelta(0))
            for address in addresses
        ]
        self._addresses = tuple(addresses)
        self._metrics = metrics
        self._dedupe = dedupe.total_seconds()
        self._recent: dict[tuple[str, int | None], float] = {}

    async def report_failure(
        self,
        replica_id: str,
        reason: str,
        *,
        reporter: str,
        teardown: bool = False,
        incarnation: int | None = None,
        unless_heard_within: float | None = None,
    ) -> Outcome:
        """Evicts `replica_id` (asking for its teardown: `teardown`); never raises (the outcome
        says what happened). With `incarnation`, only that incarnation: a report about a dead
        process whose replica is back as a newer one already is stale ("already_gone"). With
        `unless_heard_within` (seconds), only if the quorum service has not heard from the
        replica for that long either ("already_gone" otherwise); such a conditional report is
        meant to be repeated, so it is never deduplicated."""
        now = time.monotonic()
        self._recent = {r: t for r, t in self._recent.items() if now - t < self._dedupe}
        key = (replica_id, incarnation)
        if unless_heard_within is None:
            if key in self._recent:
                return "deduplicated"
            self._recent[key] = now
        outcome = await self._report(
            replica_id, reason[:1024], reporter, teardown, incarnation, unless_heard_within
        )
        if outcome == "failed":
            self._recent.pop(key, None)  # a later detection may try again
        if self._metrics is not None:
            self._metrics.quorum_reports.labels(outcome=outcome).inc()
        log.info(
            "reported %s to the quorum service: %s",
            replica_id,
            outcome,
            extra={"replica_id": replica_id, "outcome": outcome},
        )
        return outcome

    async def _report(
        self,
        replica_id: str,
        reason: str,
        reporter: str,
        teardown: bool,
        incarnation: int | None,
        unless_heard_within: float | None,
    ) -> Outcome:
        quiet = None if unless_heard_within is None else timedelta(seconds=unless_heard_within)
        for address, client in zip(self._addresses, self._clients, strict=True):
            try:
                evicted = await client.report_failure(
                    replica_id,
                    reason,
                    reporter=reporter,
                    teardown=teardown,
                    incarnation=incarnation,
                    unless_heard_within=quiet,
                )
            except UnknownReplicaError:
                return "unknown_replica"
            except (QuorumUnavailableError, TimeoutError):
                log.warning("quorum service at %s unavailable for a report", address)
                continue
            except QuorumError as exc:
                log.warning("quorum service at %s refused a report: %s", address, exc)
                return "failed"
            return "evicted" if evicted else "already_gone"
        return "failed"

    async def status(self, history_limit: int) -> StatusSnapshot:
        """The quorum service's membership and recent quorums; UpstreamError when none answers."""
        last: Exception | None = None
        for client in self._clients:
            try:
                return await client.status(history_limit=history_limit)
            except (QuorumError, TimeoutError) as exc:
                last = exc
        raise UpstreamError(f"the quorum service did not answer: {last}")

    async def teardowns(
        self,
        *,
        replicas: Collection[str] | None = None,
        on_join: Callable[[str, int], None] | None = None,
        on_resync: Callable[[MembershipEvent], None] | None = None,
    ) -> AsyncGenerator[str, None]:
        """Ids of replicas evicted with a teardown, from the quorum service's event stream
        (with `replicas`, one filtered to those: `QuorumClient.watch`); follows the addresses in
        turn while one is down, and never ends by itself. `on_join` hears every (replica,
        incarnation) that joins meanwhile; `on_resync` every new stream's snapshot, after which
        joins made while no stream was up are unknown (a filtered stream's snapshot names the
        incarnations of its replicas registered). Between streams it waits a jittered backoff
        (`WATCH_RETRY`), from scratch once a stream delivered its snapshot."""
        turn = 0
        retries = Retries(WATCH_RETRY)
        while True:
            client = self._clients[turn % len(self._clients)]
            stream = client.watch(replicas=replicas)
            try:
                async for event in stream:
                    if event.kind == "snapshot":
                        retries.succeeded()
                        if on_resync is not None:
                            on_resync(event)
                    elif event.kind == "evicted" and event.teardown and event.replica_id:
                        yield event.replica_id
                    elif (
                        event.kind == "joined"
                        and on_join is not None
                        and event.replica_id
                        and event.incarnation is not None
                    ):
                        on_join(event.replica_id, event.incarnation)
            except (QuorumError, TimeoutError) as exc:
                log.debug("quorum event stream ended: %s", exc)
                turn += 1
            finally:
                stream.cancel()  # also when the caller stops iterating: the call ends now
            await _sleep(retries.failed())

    async def close(self) -> None:
        """Closes every channel."""
        for client in self._clients:
            await client.close()
