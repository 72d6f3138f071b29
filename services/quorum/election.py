"""Which coordinator decides for a quorum service instance right now.

Without Redis there is one coordinator for the life of the instance (leader epoch 0). With
Redis, instances sharing a URL and prefix elect a leader through a lease (`lease.py`): the
leader builds a fresh coordinator over a store fenced by its epoch and restores membership and
quorum ids from Redis; a standby has no coordinator and every RPC gets `NotLeaderError`
(UNAVAILABLE), so clients fail over to the leader by themselves. When the leader must step down
(lease not renewed in time, or a fenced write), its coordinator is closed at once: waiting calls
get UNAVAILABLE and retry elsewhere."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.coordinator import Coordinator
from fthsdp.services.quorum.errors import NotLeaderError
from fthsdp.services.quorum.lease import Leadership, LeaseConfig, RedisLease
from fthsdp.services.quorum.metrics import QuorumMetrics
from fthsdp.services.quorum.store import InMemoryStore, QuorumStore
from fthsdp.services.quorum.store_redis import RedisQuorumStore

log = logging.getLogger(__name__)

ServingCallback = Callable[[bool], Awaitable[None]]


def lease_config(config: QuorumConfig) -> LeaseConfig:
    """Lease timing derived from the service config (renew 5x, poll 10x per lease)."""
    return LeaseConfig(
        ttl=config.lease_ttl,
        renew_interval=config.lease_ttl / 5,
        poll_interval=config.lease_ttl / 10,
    )


class CoordinatorSlot:
    """Holds the deciding coordinator (if any) and its leader epoch."""

    def __init__(
        self,
        config: QuorumConfig,
        metrics: QuorumMetrics,
        *,
        store: QuorumStore | None,
        on_serving: ServingCallback,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._on_serving = on_serving
        self._coordinator: Coordinator | None = None
        self._epoch = 0
        self._redis: aioredis.Redis | None = None
        self._leadership: Leadership | None = None
        self._static_store = store
        if config.redis_url is None:
            self._coordinator = Coordinator(
                config,
                store or InMemoryStore(history_size=config.history_size),
                metrics=metrics,
            )

    @property
    def coordinator(self) -> Coordinator | None:
        """The deciding coordinator; None on a standby."""
        return self._coordinator

    @property
    def leader_epoch(self) -> int:
        """The lease epoch while leading (0 without Redis)."""
        return self._epoch

    @property
    def elected(self) -> bool:
        """Whether the instance uses leader election."""
        return self._config.redis_url is not None

    def current(self) -> tuple[Coordinator, int]:
        """(coordinator, leader epoch); NotLeaderError on a standby."""
        coordinator = self._coordinator
        if coordinator is None:
            raise NotLeaderError("this quorum service instance is a standby: ask another address")
        return coordinator, self._epoch

    async def start(self, address: str) -> None:
        """Starts the static coordinator, or joins the election as `address`."""
        if self._config.redis_url is None:
            assert self._coordinator is not None
            await self._coordinator.start()
            await self._on_serving(True)
            return
        lease_ttl = self._config.lease_ttl.total_seconds()
        self._redis = aioredis.from_url(
            self._config.redis_url,
            socket_timeout=lease_ttl / 2,
            socket_connect_timeout=lease_ttl / 2,
        )
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        lease = RedisLease(
            self._redis, prefix=self._config.redis_prefix, holder=holder, address=address
        )
        self._leadership = Leadership(
            lease,
            lease_config(self._config),
            on_elected=self._take_over,
            on_deposed=self._step_down,
        )
        self._leadership.start()

    async def close(self) -> None:
        """Stops deciding (a leader releases its lease) and closes the coordinator."""
        if self._leadership is not None:
            await self._leadership.stop()  # bounded by the lease ttl, Redis reachable or not
        elif self._coordinator is not None:
            await self._coordinator.close()
        if self._redis is not None:
            # Closes sockets without a round trip; redis-py bounds each by socket_connect_timeout.
            await self._redis.aclose()

    async def _take_over(self, epoch: int) -> None:
        assert self._redis is not None and self._leadership is not None
        store = RedisQuorumStore(
            self._redis,
            prefix=self._config.redis_prefix,
            fence=epoch,
            history_size=self._config.history_size,
            on_fenced=self._leadership.step_down,
        )
        coordinator = Coordinator(self._config, store, metrics=self._metrics)
        await coordinator.start()
        self._coordinator, self._epoch = coordinator, epoch
        self._metrics.leader.set(1)
        self._metrics.leader_changes.inc()
        await self._on_serving(True)

    async def _step_down(self, reason: str) -> None:
        coordinator, self._coordinator = self._coordinator, None
        self._metrics.leader.set(0)
        await self._on_serving(False)
        if coordinator is not None:
            await coordinator.close()
        log.warning("standing by: %s", reason)
