"""Every rank's watch on a real quorum service: its own replica's eviction for a teardown calls
the rank's teardown (which, in the Manager, exits the process); other evictions do not."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

from fthsdp.services.quorum.client import MembershipEvent, QuorumClient, RankEndpoint
from fthsdp.services.quorum.server import QuorumServerThread
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.ftar import FtarConfig, FtarRing
from fthsdp.worker.ring_watch import RingWatch

_RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")


def _wait(event: threading.Event, what: str) -> None:
    assert event.wait(10), f"{what} never happened"


def test_only_a_teardown_of_its_own_replica_calls_the_ranks_teardown(
    quorum_thread: QuorumServerThread, token: str, tmp_path: Path
) -> None:
    config = ManagerConfig(
        job_id="job",
        replica_id="r1",
        replica_index=1,
        total_replicas=3,
        quorum_address=quorum_thread.address,
        checkpoint_url="http://127.0.0.1:8080",
        shm_dir=str(tmp_path),
        token=token,
    )
    client = QuorumClient(quorum_thread.address, token)
    ring = FtarRing(FtarConfig(auth_key=b"k" * 32))
    stop = threading.Event()
    torn: list[MembershipEvent] = []
    called = threading.Event()

    def on_teardown(event: MembershipEvent) -> None:
        torn.append(event)
        called.set()

    watch = RingWatch(
        config, ring=ring, plan=lambda: None, stop=stop, rank=1, on_teardown=on_teardown
    )
    try:
        incarnations = {r: client.join(r, [_RANK]) for r in ("r0", "r1", "r2")}
        watch.thread.start()
        _wait(watch.live, "the watch stream")
        # Neither another replica's teardown nor this replica's plain eviction tears it down...
        assert client.report_failure("r0", "hung rank", reporter="health", teardown=True)
        assert client.report_failure("r1", "slow", reporter="health")
        incarnations["r1"] = client.join("r1", [_RANK])
        # ...this one does (one stream, in order: the events above were seen before it).
        assert client.report_failure("r1", "hung rank", reporter="health", teardown=True)
        _wait(called, "the teardown")
        (event,) = torn
        assert (event.kind, event.replica_id, event.teardown) == ("evicted", "r1", True)
        assert event.incarnation == incarnations["r1"]
        assert "hung rank" in event.reason
    finally:
        stop.set()
        watch.close()
        ring.close()
        client.close()


def test_the_events_name_the_incarnation_they_are_about(
    quorum_thread: QuorumServerThread, token: str
) -> None:
    client = QuorumClient(quorum_thread.address, token)
    stream = client.watch(timeout=timedelta(seconds=20))
    try:
        assert next(stream).kind == "snapshot"
        first = client.join("r0", [_RANK])
        second = client.join("r0", [_RANK])  # a restart: the first incarnation is superseded
        seen = [next(stream) for _ in range(3)]
        assert [(e.kind, e.incarnation, e.teardown) for e in seen] == [
            ("joined", first, False),
            ("evicted", first, False),
            ("joined", second, False),
        ]
    finally:
        stream.cancel()
        client.close()
