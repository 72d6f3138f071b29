"""The replica leader's link to the quorum service (DESIGN.md step 1).

Rank 0 of a replica joins the service, asks for each step's quorum (off the training thread,
while the forward pass runs), heartbeats whenever no request has reached the service for a
heartbeat interval, and joins again as a new incarnation after an eviction or a service
restart. When no instance of the service answers within `control_plane_grace`, a request that
was given a fallback plan returns it, so the step goes on on the previous quorum where that is
safe (`worker.plan.fallback_payload` says when). What a request returns is the payload the leader
broadcasts inside its replica: a quorum, or an error that every rank raises."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Protocol

from fthsdp.services.quorum.client import (
    Quorum,
    QuorumClient,
    QuorumUnavailableError,
    RankEndpoint,
    StaleIncarnationError,
    StepWork,
)
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.plan import encode_failure, encode_steady

log = logging.getLogger(__name__)


class HeldStream(Protocol):
    """The leader's Watch stream, as far as heartbeats care (`RingWatch`)."""

    def holds(self, incarnation: int) -> bool: ...

    def renew_for(self, incarnation: int) -> None: ...


class QuorumLink:
    """One replica leader's requests, heartbeats and membership with the quorum service."""

    def __init__(
        self, config: ManagerConfig, endpoints: list[RankEndpoint], stop: threading.Event
    ) -> None:
        """Joins the service (raises if it cannot be reached)."""
        self._config = config
        self._endpoints = endpoints
        self._stop = stop
        self._client = QuorumClient(config.quorum_address, config.token)
        self._lock = threading.Lock()
        self._incarnation = self._client.join(config.replica_id, endpoints)
        self._last_contact = 0.0
        """Monotonic time a quorum request last went out or was answered (0: none got through)."""
        self._down = False
        """The last step went on without the quorum service."""
        self._encoded: tuple[Quorum, bytes] | None = None
        """The last quorum answered and its payload (a steady one is re-stamped, not encoded)."""

    def current_incarnation(self) -> int:
        """`incarnation`, as a callable for whom follows it (the leader's Watch stream)."""
        return self.incarnation

    @property
    def incarnation(self) -> int:
        """This replica's incarnation with the service (changes on a rejoin)."""
        with self._lock:
            return self._incarnation

    def request(
        self,
        step: int,
        *,
        commit_failed: bool,
        fallback: bytes | None,
        work: StepWork | None = None,
    ) -> bytes:
        """The quorum for this replica at `step`, as the broadcast payload. With `fallback`,
        an unreachable service is waited for only `control_plane_grace` (not at all again
        while it stays down) before `fallback` is returned instead."""
        replica = self._config.replica_id
        deadline = time.monotonic() + self._config.quorum_timeout.total_seconds()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                return encode_failure("no quorum within quorum_timeout")
            try:
                self._last_contact = time.monotonic()
                quorum = self._client.quorum(
                    replica,
                    self.incarnation,
                    step,
                    commit_failed=commit_failed,
                    timeout=timedelta(seconds=remaining),
                    unavailable_budget=None if fallback is None else self._grace(),
                    work=work,
                )
                self._last_contact = time.monotonic()
                self._down = False
                payload = encode_steady(self._encoded, quorum, replica)
                self._encoded = (quorum, payload)
                return payload
            except QuorumUnavailableError as exc:
                self._last_contact = 0.0  # nothing reached the service: heartbeats resume
                if fallback is None:
                    return encode_failure(f"quorum request failed: {exc}")
                if not self._down:
                    log.warning(
                        "quorum service unreachable; training on the previous quorum",
                        extra=self._context(step=step, error=str(exc)),
                    )
                self._down = True
                return fallback
            except StaleIncarnationError:
                # Evicted, or the service restarted and forgot us: our state is still valid at
                # our step, so join again as a new incarnation.
                with self._lock:
                    self._incarnation = self._client.join(replica, self._endpoints)
                log.warning("rejoined the quorum", extra=self._context(step=step))
            except TimeoutError:
                continue
            except Exception as exc:  # the broadcast must happen, or the other ranks hang
                return encode_failure(f"quorum request failed: {exc}")

    def _grace(self) -> timedelta:
        """How long to wait for an unreachable service: the configured grace, and after one
        step went on without it, only one try of each instance (no extra wait per step)."""
        grace = self._config.control_plane_grace
        return timedelta(0) if self._down or grace is None else grace

    def heartbeat_loop(self, watch: HeldStream | None = None) -> None:
        """Thread body until `stop`: beats only when no quorum request reached the service
        within the interval. Asking for a quorum (and waiting in one) counts as alive there,
        so while steps are faster than the interval the per-step request is the heartbeat and
        this thread stays quiet; so does the leader's Watch stream (`watch`) while it holds the
        current incarnation: the service pings its connection instead, no call per beat."""
        interval = self._config.heartbeat_interval.total_seconds()
        delay = interval
        while not self._stop.wait(delay):
            if watch is not None:
                incarnation = self.incarnation
                if watch.holds(incarnation):
                    delay = interval
                    continue
                watch.renew_for(incarnation)
            quiet = time.monotonic() - self._last_contact
            if quiet < interval:
                delay = interval - quiet
                continue
            delay = interval
            try:
                self._client.heartbeat(self._config.replica_id, self.incarnation)
            except Exception as exc:  # the quorum request path rejoins; keep beating
                log.debug("heartbeat failed: %s", exc, extra=self._context())

    def close(self) -> None:
        """Leaves the quorum gracefully (best effort) and closes the channel."""
        try:
            self._client.leave(self._config.replica_id, self.incarnation)
        except Exception as exc:
            log.debug("leave failed: %s", exc, extra=self._context())
        self._client.close()

    def _context(self, **fields: object) -> dict[str, object]:
        return {"replica_id": self._config.replica_id, "rank": 0, **fields}


_AWAIT_POLL_S = 0.2
"""How often a waiting leader asks how many replicas registered: every leader of a job asks
at once (1,536 leaders: ~7,700 Status calls a second, where every 50 ms was ~30,000)."""


def await_replicas(config: ManagerConfig, stop: threading.Event) -> None:
    """Waits up to `config.await_replicas` until every replica of the job has registered with
    the quorum service; a wait that runs out, or a service that cannot say, is logged and
    training starts (the quorum service decides who trains anyway). Its own client: the link's
    heartbeats go on meanwhile."""
    wait_s = config.await_replicas.total_seconds()
    deadline = time.monotonic() + wait_s
    context = {"replica_id": config.replica_id, "rank": 0}
    client = QuorumClient(config.quorum_address, config.token, connect_timeout=timedelta(seconds=2))
    try:
        while not stop.is_set():
            # The newest quorum only (0 would be the whole history): every leader of the job
            # polls at once.
            registered = len(client.status(history_limit=1).members)
            if registered >= config.total_replicas:
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "%d of %d replicas registered in %.0f s: training starts without the others",
                    registered, config.total_replicas, wait_s, extra=context,
                )  # fmt: skip
                return
            stop.wait(_AWAIT_POLL_S)
    except Exception as exc:
        log.warning("could not wait for the other replicas: %s", exc, extra=context)
    finally:
        client.close()
