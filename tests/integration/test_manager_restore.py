"""A full restart's durable restore comes before the replica joins: a restore takes seconds for
a real model, and a replica that joined first was silent through it (its heartbeats and Watch
stream start after the restore), so the quorum service evicted it and it joined again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fthsdp.services.quorum.client import MembershipEvent
from fthsdp.worker.manager import Manager
from tests.integration.manager_faults_support import replica
from tests.integration.manager_support import control_plane

pytestmark = pytest.mark.timeout(60)

RESTORE_S = 2.0
"""Twice the quorum service's heartbeat timeout (1 s, the LocalStack default)."""


def test_a_restore_longer_than_the_heartbeat_timeout_does_not_get_the_replica_evicted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    restored: list[float] = []

    def slow_restore(self: Manager) -> None:  # a durable checkpoint of a real model loading
        time.sleep(RESTORE_S)
        restored.append(time.monotonic())

    monkeypatch.setattr(Manager, "_restore_durable", slow_restore)
    with control_plane(tmp_path, total_replicas=1) as stack:
        client = stack.local.quorum_client()
        stream = client.watch()
        try:
            assert next(stream).kind == "snapshot"
            r0 = replica(stack, "r0", 0)
            try:
                r0.train_until(2)
            finally:
                r0.manager.shutdown()
            seen: list[MembershipEvent] = []
            while not any(e.kind == "left" for e in seen):
                seen.append(next(stream))
        finally:
            stream.cancel()
            client.close()
    assert restored
    about_r0 = [(e.kind, e.reason) for e in seen if e.replica_id == "r0"]
    assert [kind for kind, _ in about_r0] == ["joined", "left"], about_r0
