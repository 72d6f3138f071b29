"""The leader's start wait (`ManagerConfig.await_replicas`, `worker.quorum_link.await_replicas`)
against a real quorum service: it ends when the last replica of the job registers, gives up after
its bound, and ends at once when the Manager stops."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from fthsdp.services.quorum.client import QuorumClient, RankEndpoint
from fthsdp.services.quorum.server import QuorumServerThread
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.quorum_link import await_replicas

RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")


@pytest.fixture
def service(make_quorum_thread: Callable[..., QuorumServerThread]) -> QuorumServerThread:
    # Registered replicas stay members for the test's length without heartbeats.
    return make_quorum_thread(heartbeat_timeout=timedelta(seconds=60))


def _config(address: str, token: str, wait_s: float) -> ManagerConfig:
    return ManagerConfig(
        job_id="job",
        replica_id="r0",
        replica_index=0,
        total_replicas=2,
        quorum_address=address,
        checkpoint_url="http://127.0.0.1:9",
        token=token,
        await_replicas=timedelta(seconds=wait_s),
    )


def _waiting(config: ManagerConfig, stop: threading.Event) -> tuple[threading.Thread, list[float]]:
    ended: list[float] = []

    def wait() -> None:
        await_replicas(config, stop)
        ended.append(time.monotonic())

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, ended


def test_the_wait_ends_when_the_last_replica_registers(
    service: QuorumServerThread, token: str
) -> None:
    client = QuorumClient(service.address, token)
    try:
        client.join("r0", [RANK])
        thread, ended = _waiting(_config(service.address, token, 30.0), threading.Event())
        thread.join(0.5)
        assert thread.is_alive(), "one of two replicas registered: the wait must go on"
        client.join("r1", [RANK])
        thread.join(10)  # far below its 30 s bound: the registration ended it
        assert not thread.is_alive() and ended
    finally:
        client.close()


def test_the_wait_gives_up_after_its_bound(service: QuorumServerThread, token: str) -> None:
    started = time.monotonic()
    thread, ended = _waiting(_config(service.address, token, 0.5), threading.Event())
    thread.join(10)
    assert not thread.is_alive() and ended[0] - started >= 0.5


def test_the_wait_ends_when_the_manager_stops(service: QuorumServerThread, token: str) -> None:
    stop = threading.Event()
    thread, _ = _waiting(_config(service.address, token, 60.0), stop)
    thread.join(0.3)
    assert thread.is_alive()
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_a_service_that_cannot_say_ends_the_wait(token: str) -> None:
    # Nothing listens there: the wait is logged and training starts.
    thread, ended = _waiting(_config("127.0.0.1:9", token, 60.0), threading.Event())
    thread.join(20)
    assert not thread.is_alive() and ended
