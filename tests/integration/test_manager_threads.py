"""What runs beside a Manager's training thread, with real services: a quorum request has its own
thread (it never queues behind a catch-up fetch or a position record), and a catch-up fetch
waiting for a snapshot nobody publishes stops when its attempt is given up."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from fthsdp.worker.peer_state import PeerState, StateFetchError
from fthsdp.worker.plan import Source
from tests.integration.manager_support import batch, control_plane, lone_replica, run_replicas

pytestmark = pytest.mark.timeout(120)


def test_a_quorum_request_does_not_wait_for_busy_background_work(tmp_path: Path) -> None:
    with lone_replica(tmp_path) as (manager, optimizer):
        release = threading.Event()
        # Both workers of the pool that fetches and records are busy, as with a slow fetch.
        busy = [manager._executor.submit(release.wait) for _ in range(2)]
        try:

            def train() -> int:
                for _ in range(3):
                    optimizer.zero_grad()
                    x, y = batch(0, manager.step)
                    torch.nn.functional.mse_loss(manager.model(x), y).backward()
                    optimizer.step()
                return manager.step

            (step,) = run_replicas(train, timeout_s=60)
            assert step == 3
            assert not any(f.done() for f in busy)  # trained while the pool stayed blocked
        finally:
            release.set()


def test_a_fetch_waiting_for_an_unpublished_snapshot_stops_when_cancelled(
    tmp_path: Path,
) -> None:
    with control_plane(tmp_path, total_replicas=2) as stack:
        config = stack.config("r1", 1)  # fetch_timeout: the default 60 s
        peers = PeerState(config=config, rank=0, world_size=1)
        source = Source(replica_id="r0", url=stack.local.sidecars["host"].url)
        cancelled = threading.Event()
        outcome: list[BaseException] = []

        def fetch() -> None:
            try:
                peers.fetch_peer([source], 7, cancelled=cancelled)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=fetch, daemon=True)
        thread.start()
        deadline = time.monotonic() + 1.0
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(0.05)  # the fetch keeps polling for step 7: nobody publishes it
        assert thread.is_alive(), outcome
        cancelled.set()
        thread.join(30)  # far below fetch_timeout: only the cancellation ends it this soon
        assert not thread.is_alive()
        (error,) = outcome
        assert isinstance(error, StateFetchError) and "cancelled" in str(error), error
