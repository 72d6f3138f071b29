"""Stopping a quorum service leader that is partitioned from Redis (its link blackholed: packets
vanish, no RST) ends in bounded time, whenever the stop comes: while the leader still trusts its
lease, in the middle of the step-down the partition forces, or after it; in process and as a
process on SIGTERM. And a stopped instance never holds the lease again once Redis is back.

The bound is the property, not a timing figure: a stopping leader has nothing to wait for on
Redis for longer than its lease, because a lease it cannot release expires there by itself within
one TTL (and its fencing epoch refuses it anyway), so stop() must end within the drain grace plus
a few lease periods however Redis behaves. The bounds below are several TTLs above that, loose for
a loaded machine, while the failure they catch is a stop that never ends."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import pytest
import redis.asyncio as aioredis

from fthsdp.bench.quorum_failover import QuorumProcess
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.lease import RedisLease
from fthsdp.services.quorum.server import QuorumServer
from tests.integration.conftest import eventually
from tests.redis_support import RedisServer
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.redis

TTL = timedelta(milliseconds=600)
GRACE = timedelta(milliseconds=200)
STOP_BOUND = 5.0
"""Seconds stop() may take: grace + a few TTLs is what the design needs (see the module doc)."""
PREFIX = "fthsdp:quorum"


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the test's redis-server (the leader's link to cut)."""
    started = TcpProxy("127.0.0.1", redis_server.port).start()
    yield started
    started.stop()


@pytest.fixture
async def lease_view(redis_server: RedisServer) -> AsyncIterator[RedisLease]:
    """Reads the lease key directly (not through the proxy)."""
    client = aioredis.from_url(redis_server.url)
    yield RedisLease(client, prefix=PREFIX, holder="observer", address="observer:0")
    await client.aclose()


def _via(proxy: TcpProxy, redis_server: RedisServer) -> str:
    return redis_server.url.replace(str(redis_server.port), str(proxy.port))


class _OnStepDown(logging.Handler):
    """Starts `server.stop()` from inside the leader's step-down: the record is logged by the
    election loop just before it closes its coordinator, so the stop's cancellation of that loop
    lands in the middle of the step-down, every time."""

    def __init__(self, server: QuorumServer) -> None:
        super().__init__(logging.WARNING)
        self._server = server
        self.stopping: asyncio.Task[None] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.stopping is None and record.getMessage().startswith("stepping down"):
            self.stopping = asyncio.get_running_loop().create_task(self._server.stop(GRACE))


@pytest.mark.parametrize("when", ["leading", "stepping-down", "standing-by"])
async def test_a_leader_cut_off_from_redis_stops_in_bounded_time(
    when: str,
    redis_server: RedisServer,
    proxy: TcpProxy,
    lease_view: RedisLease,
    token: str,
) -> None:
    config = QuorumConfig(port=0, admin_port=0, redis_url=_via(proxy, redis_server), lease_ttl=TTL)
    server = QuorumServer(config, token)
    hook = _OnStepDown(server)
    lease_log = logging.getLogger("fthsdp.services.quorum.lease")
    # The hook listens for a WARNING: pass it whatever level the root logger was left at.
    level = lease_log.level
    lease_log.setLevel(logging.WARNING)
    await server.start()
    stopping: asyncio.Task[None] | None = None
    try:
        await eventually(lambda: _true(server.is_leader))
        if when == "stepping-down":
            lease_log.addHandler(hook)
        proxy.blackhole()
        if when == "stepping-down":
            await eventually(lambda: _true(hook.stopping is not None), seconds=5 * STOP_BOUND)
            stopping = hook.stopping
        else:
            if when == "standing-by":
                await eventually(lambda: _true(not server.is_leader), seconds=5 * STOP_BOUND)
            stopping = asyncio.create_task(server.stop(GRACE))
        assert stopping is not None
        started = time.monotonic()
        done, _ = await asyncio.wait({stopping}, timeout=STOP_BOUND)
        assert done, f"stop() still running {STOP_BOUND} s after it began ({when})"
        stopping.result()
        assert time.monotonic() - started < STOP_BOUND
        assert not server.is_leader and not server.is_serving()

        # Redis reachable again: the stopped instance must not campaign. Its lease (if it still
        # held one) has expired; nobody holds it after two lease periods.
        proxy.heal()
        await asyncio.sleep(2 * TTL.total_seconds())
        assert await lease_view.holder_now() is None
    finally:
        lease_log.removeHandler(hook)
        lease_log.setLevel(level)
        proxy.heal()
        if stopping is not None and not stopping.done():
            stopping.cancel()
            await asyncio.wait({stopping}, timeout=STOP_BOUND)
        else:
            await asyncio.wait_for(server.stop(GRACE), timeout=STOP_BOUND)


@pytest.mark.timeout(60)
def test_sigterm_ends_a_leader_cut_off_from_redis_in_bounded_time(
    redis_server: RedisServer, proxy: TcpProxy, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process path: SIGTERM drains (grace) and exits 0 within the bound, Redis or not."""
    grace_ms = int(GRACE.total_seconds() * 1000)
    monkeypatch.setenv("FTHSDP_QUORUM_SHUTDOWN_GRACE_MS", str(grace_ms))
    ttl_ms = int(TTL.total_seconds() * 1000)
    leader = QuorumProcess(_via(proxy, redis_server), token, PREFIX, lease_ttl_ms=ttl_ms)
    try:
        deadline = time.monotonic() + 15
        while not leader.leads():
            assert time.monotonic() < deadline, "the process was not elected"
            time.sleep(0.02)
        proxy.blackhole()
        leader.proc.send_signal(signal.SIGTERM)
        try:
            code = leader.proc.wait(timeout=STOP_BOUND)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_BOUND} s after SIGTERM")
        assert code == 0
    finally:
        leader.kill()


async def _true(value: bool) -> bool:
    return value
