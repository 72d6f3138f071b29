"""`fthsdp up` as a real process: its services answer the real clients, a SIGKILLed service comes
back on the same address, SIGTERM stops every child. The `--redis` variant runs a leader and a
standby on a private Redis; when the leader is SIGKILLed, a live instance leads again and the
membership survives (I5)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from fthsdp.services.common.tokens import load_token
from fthsdp.services.quorum.client import QuorumClient
from fthsdp.services.quorum.domain import RankEndpoint
from tests.e2e.up_support import Up, wait_for
from tests.redis_support import redis_binary

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _http_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1.0).status_code
    except httpx.HTTPError:
        return None


def _client(address: str, token: str) -> QuorumClient:
    return QuorumClient(address, token, connect_timeout=timedelta(seconds=20))


def _join_and_status(address: str, token: str, replica: str, checkpoint: str) -> int:
    """Joins `replica` and returns the answering leader's lease epoch."""
    with _client(address, token) as client:
        incarnation = client.join(
            replica, [RankEndpoint(ftar="127.0.0.1:1", checkpoint=checkpoint)]
        )
        assert incarnation >= 1
        status = client.status()
        assert replica in {m.replica_id for m in status.members}
        return status.leader_epoch


def test_up_serves_restarts_a_killed_service_and_stops_everything(
    start_up: Callable[..., Up],
) -> None:
    up = start_up()
    env = up.env()
    token = load_token(path=env["FTHSDP_TOKEN_FILE"]).value
    assert token not in up.output(), "the token must never be printed"
    checkpoint = env["FTHSDP_CHECKPOINT_URL"]
    _join_and_status(env["FTHSDP_QUORUM"], token, "r0", checkpoint)
    assert _http_status(f"{checkpoint}/readyz") == 200
    services = up.services()
    assert _http_status(f"{env['FTHSDP_HEALTH_URL']}/livez") == 200
    for spec in services.values():
        host = spec["addresses"].get("grpc", spec["addresses"].get("http", ""))
        assert "127.0.0.1" in host, "up binds loopback by default"

    killed = up.pid("quorum")
    os.kill(killed, signal.SIGKILL)
    wait_for("a new quorum process", lambda: up.pid("quorum") != killed)
    assert up.services()["quorum"]["restarts"] == 1
    assert "quorum (pid" in up.output() and "killed by SIGKILL" in up.output()
    # Same address after the restart: a fresh in-memory store, so r0 joins again.
    _join_and_status(env["FTHSDP_QUORUM"], token, "r0", checkpoint)
    wait_for("the restart to be reported ready", lambda: "quorum is ready again" in up.output())

    children = [up.pid(name) for name in up.services()]
    assert up.stop() == 0
    assert all(_gone(pid) for pid in children), "a child outlived fthsdp up"
    assert not (up.run_dir / "fthsdp.env").exists(), "the env file outlived the stack"
    assert _http_status(f"{checkpoint}/livez") is None


@pytest.mark.redis
def test_up_with_redis_elects_a_new_leader_when_the_leader_dies(
    start_up: Callable[..., Up],
) -> None:
    if redis_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: scripts/bootstrap.sh should have installed it")
        pytest.skip("redis-server is not installed (run scripts/bootstrap.sh)")
    # A long heartbeat timeout keeps r0 registered (it never heartbeats) through the failover.
    up = start_up("--redis", "--lease-ttl-ms", "1000", "--heartbeat-timeout-ms", "60000")
    env = up.env()
    token = load_token(path=env["FTHSDP_TOKEN_FILE"]).value
    addresses = env["FTHSDP_QUORUM"].split(",")
    assert len(addresses) == 2
    services = up.services()
    assert {"redis", "quorum-a", "quorum-b", "checkpoint"} <= set(services)

    def leader() -> str | None:
        ready = [
            name
            for name in ("quorum-a", "quorum-b")
            if _http_status(f"{up.services()[name]['addresses']['admin']}/readyz") == 200
        ]
        assert len(ready) <= 1, "two leaders"
        return ready[0] if ready else None

    first = wait_for("a leader", leader)
    # The client gets both addresses and finds the leader itself.
    first_epoch = _join_and_status(env["FTHSDP_QUORUM"], token, "r0", env["FTHSDP_CHECKPOINT_URL"])
    assert first_epoch >= 1, "a leader elected through the Redis lease has an epoch"

    killed = up.pid(first)
    os.kill(killed, signal.SIGKILL)

    def new_leader() -> str | None:
        # Which live process wins the expired lease is a race by design (the standby, or the
        # killed instance once `up` restarted it); what must hold whoever wins: one leader, not
        # the dead process, under a newer lease epoch (the fencing token of I5).
        current = leader()
        return current if current and up.pid(current) != killed else None

    wait_for("a new leader", new_leader)
    with _client(env["FTHSDP_QUORUM"], token) as client:
        status = client.status()
    assert status.leader_epoch > first_epoch, "the new leader must hold a newer lease"
    # I5: the membership lives in Redis, so the new leader knows r0 without a new join.
    assert [m.replica_id for m in status.members] == ["r0"], "I5: membership lost"
    wait_for(f"{first} to be restarted", lambda: up.pid(first) != killed)
    admin = up.services()[first]["addresses"]["admin"]
    wait_for(f"{first} to be live again", lambda: _http_status(f"{admin}/livez") == 200)

    children = [up.pid(name) for name in up.services()]
    assert up.stop() == 0
    assert all(_gone(pid) for pid in children), "a child outlived fthsdp up"
