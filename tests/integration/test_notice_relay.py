"""The replica's relay tree over real sockets: events reach every rank below the leader in order,
a late child gets the latest snapshot first, only holders of the job's key connect, a clean
shutdown ends a child's stream while a parent's death is reported as such, and a rank whose
parent died tears itself down (`RingWatch`). The tree is what lets only the leader hold a Watch
stream (issue 14: ~98K streams at 12 x 8,192 ranks before)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fthsdp.services.quorum.client import MembershipEvent, QuorumClient, RankEndpoint
from fthsdp.services.quorum.server import QuorumServerThread
from fthsdp.worker.ftar import FtarConfig, FtarRing
from fthsdp.worker.notice_relay import (
    FANOUT,
    MAGIC,
    MAX_FRAME_BYTES,
    NoticeRelay,
    RelayError,
    Upstream,
    UpstreamLost,
    encode_event,
    has_children,
    parent_of,
    relay_key,
)
from fthsdp.worker.ring_watch import RingWatch
from tests.integration.test_ftar_support import wait_for
from tests.integration.test_ring_watch import _config, _wait

KEY = relay_key("job-token")


def _event(kind: str, replica_id: str | None = "r2", **extra: object) -> MembershipEvent:
    return MembershipEvent(kind=kind, replica_id=replica_id, quorum_id=7, reason="test", **extra)  # type: ignore[arg-type]


def test_the_tree_covers_every_rank_once_with_a_bounded_fanout() -> None:
    world = 8192
    children: dict[int, list[int]] = {}
    for rank in range(1, world):
        parent = parent_of(rank)
        assert parent is not None and parent < rank
        children.setdefault(parent, []).append(rank)
    assert parent_of(0) is None
    assert max(len(c) for c in children.values()) == FANOUT
    assert {r for r in range(world) if has_children(r, world)} == set(children)
    depth = 0
    rank = world - 1
    while (parent := parent_of(rank)) is not None:
        rank, depth = parent, depth + 1
    assert depth <= 4  # log16(8192) rounded up


def test_events_pass_down_two_levels_in_order_and_a_late_child_gets_the_snapshot() -> None:
    root = NoticeRelay("127.0.0.1", KEY)
    middle = NoticeRelay("127.0.0.1", KEY)
    child = grandchild = None
    try:
        child = Upstream(root.address, KEY)
        wait_for(lambda: root.children == 1)
        snapshot = encode_event(_event("snapshot", None, members=("r0", "r1", "r2")))
        root.forward(snapshot, snapshot=True)
        first, payload = next(child)
        assert first.kind == "snapshot" and first.members == ("r0", "r1", "r2")
        middle.forward(payload, snapshot=True)  # the middle rank passes on what it got
        grandchild = Upstream(middle.address, KEY)  # connects after: the snapshot comes first
        assert next(grandchild)[0].kind == "snapshot"
        evicted = _event("evicted", teardown=True, incarnation=3)
        for event in (evicted, _event("joined", incarnation=4)):
            root.forward(encode_event(event))
            _, payload = next(child)
            middle.forward(payload)
        assert [next(grandchild)[0] for _ in range(2)] == [evicted, _event("joined", incarnation=4)]
    finally:
        for up in (child, grandchild):
            if up is not None:
                up.cancel()
        root.close()
        middle.close()


def test_a_clean_close_ends_the_stream_and_a_dead_parent_is_reported() -> None:
    relay = NoticeRelay("127.0.0.1", KEY)
    child = Upstream(relay.address, KEY)
    wait_for(lambda: relay.children == 1)
    relay.close()
    with pytest.raises(StopIteration):
        next(child)
    with _parent_process() as (parent, address):
        upstream = Upstream(address, KEY)
        assert next(upstream)[0].kind == "snapshot"
        parent.kill()  # SIGKILL: no goodbye, the kernel closes its sockets
        with pytest.raises(UpstreamLost):
            next(upstream)


def test_only_holders_of_the_key_connect_either_way() -> None:
    relay = NoticeRelay("127.0.0.1", KEY)
    try:
        with pytest.raises(RelayError, match="ended the handshake"):
            Upstream(relay.address, relay_key("another job"))
        assert relay.children == 0
        # A raw client that proves nothing gets no events and is dropped.
        with socket.create_connection(relay.address.rsplit(":", 1)) as raw:  # type: ignore[arg-type]
            assert raw.recv(len(MAGIC)) == MAGIC
            raw.sendall(b"\0" * 48)
            raw.settimeout(5)
            _recv_until_closed(raw)
        assert relay.children == 0
        # A listener that is not a relay is refused by the child.
        not_relay = socket.create_server(("127.0.0.1", 0))
        port = not_relay.getsockname()[1]
        accepted: list[socket.socket] = []
        t = threading.Thread(
            target=lambda: accepted.append(_greet(not_relay, b"HTTP/1.1 200 OK\r\n"))
        )
        t.start()
        with pytest.raises(RelayError, match="not a notice relay"):
            Upstream(f"127.0.0.1:{port}", KEY)
        t.join()
        not_relay.close()
        for conn in accepted:
            conn.close()
    finally:
        relay.close()


def test_an_oversized_frame_is_refused() -> None:
    relay = NoticeRelay("127.0.0.1", KEY)
    try:
        upstream = Upstream(relay.address, KEY)
        wait_for(lambda: relay.children == 1)
        relay.forward(b"x" * (MAX_FRAME_BYTES + 1))
        with pytest.raises(RelayError, match="bytes"):
            next(upstream)
    finally:
        relay.close()


def test_the_replicas_teardown_reaches_a_rank_through_the_leader(
    quorum_thread: QuorumServerThread, token: str, tmp_path: Path
) -> None:
    """The leader's watch (a Watch stream) forwards to rank 1's watch (its relay child), which
    tears down on its replica's own teardown, not on another's; a clean close of the leader's
    relay (its Manager shutting down) is no teardown."""
    config = _config(quorum_thread.address, token, tmp_path)
    client = QuorumClient(quorum_thread.address, token)
    stop = threading.Event()
    rings = [FtarRing(FtarConfig(auth_key=b"k" * 32)) for _ in range(2)]
    torn: list[MembershipEvent] = []
    relay = NoticeRelay("127.0.0.1", relay_key(token))
    leader = RingWatch(config, ring=rings[0], plan=lambda: None, stop=stop, rank=0, relay=relay)
    rank = RingWatch(
        config,
        ring=rings[1],
        plan=lambda: None,
        stop=stop,
        rank=1,
        on_teardown=torn.append,
        upstream=relay.address,
    )
    try:
        leader.thread.start()
        _wait(leader.live, "the leader's stream")
        rank.thread.start()
        _wait(rank.live, "rank 1's relay (the leader's snapshot)")
        ranks = [RankEndpoint(ftar="127.0.0.1:1", checkpoint="http://127.0.0.1:2")]
        incarnations = {r: client.join(r, ranks) for r in ("r0", "r1")}
        assert client.report_failure("r0", "hung rank", reporter="health", teardown=True)
        assert client.report_failure("r1", "hung rank", reporter="health", teardown=True)
        wait_for(lambda: len(torn) == 1)
        assert (torn[0].kind, torn[0].replica_id, torn[0].teardown) == ("evicted", "r1", True)
        assert torn[0].incarnation == incarnations["r1"]
        relay.close()
        with pytest.raises(AssertionError):  # a goodbye: rank 1 keeps going, no teardown
            wait_for(lambda: len(torn) > 1, 1.0)
    finally:
        stop.set()
        for watch in (leader, rank):
            watch.close()
        for ring in rings:
            ring.close()
        client.close()


def test_a_rank_whose_parent_process_died_tears_itself_down(token: str, tmp_path: Path) -> None:
    """A replica is the unit of failure: once its parent rank is SIGKILLed, a rank stops at once
    instead of waiting for the health service's teardown (which no longer reaches it)."""
    torn: list[MembershipEvent] = []
    stop = threading.Event()
    ring = FtarRing(FtarConfig(auth_key=b"k" * 32))
    with _parent_process() as (parent, address):
        watch = RingWatch(
            _config("127.0.0.1:1", "job-token", tmp_path),
            ring=ring,
            plan=lambda: None,
            stop=stop,
            rank=1,
            on_teardown=torn.append,
            upstream=address,
        )
        try:
            watch.thread.start()
            _wait(watch.live, "the relay's snapshot")
            assert torn == []
            parent.kill()
            wait_for(lambda: len(torn) == 1)
            assert torn[0].teardown and "died" in torn[0].reason
        finally:
            stop.set()
            watch.close()
            ring.close()


# ---- helpers -------------------------------------------------------------------------------

_PARENT = """
import sys, time
from fthsdp.services.quorum.domain import MembershipEvent
from fthsdp.worker.notice_relay import NoticeRelay, encode_event, relay_key
relay = NoticeRelay("127.0.0.1", relay_key(sys.argv[1]))
snapshot = MembershipEvent(kind="snapshot", replica_id=None, quorum_id=1, reason="hello")
relay.forward(encode_event(snapshot), snapshot=True)
print(relay.address, flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def _parent_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A parent rank's relay in its own process, to be SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT, "job-token"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the parent process printed no address"
        yield proc, address
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _greet(listener: socket.socket, greeting: bytes) -> socket.socket:
    conn, _ = listener.accept()
    conn.sendall(greeting.ljust(len(MAGIC) + 16, b"\0"))
    return conn


def _recv_until_closed(sock: socket.socket) -> None:
    while sock.recv(4096):
        pass
