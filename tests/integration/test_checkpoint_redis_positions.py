"""Data positions in Redis behind real sidecars: shared between the sidecars of a job (a replica
restarted on another host resumes at its committed position, I2) and kept through a Redis crash
(append-only file); the rewind semantics of the timeline hold in Redis too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fthsdp.services.checkpoint.client import get_position, put_position
from fthsdp.services.checkpoint.core import PositionRecord
from fthsdp.services.checkpoint.server import CheckpointServer
from fthsdp.services.checkpoint.store_redis import RedisPositionStore
from tests.integration.test_checkpoint_support import JOB, sidecars
from tests.redis_support import RedisServer

__all__ = ["sidecars"]
pytestmark = pytest.mark.redis
Start = Callable[..., CheckpointServer]


def test_positions_are_shared_across_sidecars_and_survive_a_redis_crash(
    sidecars: Start, token: str, redis_server: RedisServer, tmp_path: Path
) -> None:
    host_a = sidecars(root=tmp_path / "a", redis_url=redis_server.url)
    host_b = sidecars(root=tmp_path / "b", redis_url=redis_server.url)
    for step in (1, 2, 5):
        put_position(host_a.url, token, job=JOB, replica="r0", step=step, position={"s": step})

    def read(server: CheckpointServer, at_step: int | None = None) -> tuple[int, dict[str, int]]:
        record = get_position(server.url, token, job=JOB, replica="r0", at_step=at_step)
        assert record is not None
        return record.step, dict(record.position)

    assert read(host_b) == (5, {"s": 5})  # the replica moved hosts
    assert read(host_b, at_step=4) == (2, {"s": 2})
    redis_server.kill()
    redis_server.start()
    assert read(host_a) == (5, {"s": 5})


def test_a_rewind_abandons_the_recorded_future_and_history_is_bounded(
    redis_server: RedisServer,
) -> None:
    store = RedisPositionStore(redis_server.url, max_records=3)
    try:
        for step in range(1, 6):
            store.append(JOB, "r0", PositionRecord(step, {"s": step}))
        assert store.at(JOB, "r0", 1) is None  # trimmed: only the newest three remain
        assert store.at(JOB, "r0", 3) == PositionRecord(3, {"s": 3})
        store.append(JOB, "r0", PositionRecord(4, {"s": 40}))  # restored from step 4
        assert store.at(JOB, "r0", None) == PositionRecord(4, {"s": 40})
        assert store.at(JOB, "r0", 5) == PositionRecord(4, {"s": 40})
        assert store.at(JOB, "r1", None) is None
    finally:
        store.close()
