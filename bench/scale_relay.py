"""The cost of one hop of a replica's notice relay (worker/notice_relay.py), measured on the real
code over loopback: a parent with `FANOUT` children (real sockets, the real handshake), each event
forwarded to all of them; a hop lasts from `forward()` until the last child has decoded the
event. bench.scale's emulated ranks then hear an event `depth x hop` after their leader does (the
tree of a 98K-rank job is not built here: its hops run in parallel on separate hosts)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from fthsdp.services.quorum.domain import MembershipEvent
from fthsdp.worker.notice_relay import FANOUT, NoticeRelay, Upstream, encode_event, parent_of


def depth(rank: int) -> int:
    """Hops between the leader and `rank` in the relay tree."""
    hops = 0
    while (parent := parent_of(rank)) is not None:
        rank, hops = parent, hops + 1
    return hops


def measure_hop(samples: int = 200, members: int = 12) -> dict[str, Any]:
    """Median and p99 seconds of one hop, for an eviction event naming `members` replicas."""
    key = b"k" * 32
    relay = NoticeRelay("127.0.0.1", key)
    children = [Upstream(relay.address, key) for _ in range(FANOUT)]
    deadline = time.monotonic() + 10
    while relay.children < FANOUT:
        if time.monotonic() > deadline:
            raise TimeoutError("the relay's children never connected")
        time.sleep(0.001)
    received = [[0.0] * samples for _ in children]
    done = threading.Barrier(FANOUT + 1)

    def follow(k: int, upstream: Upstream) -> None:
        for n in range(samples):
            next(upstream)
            received[k][n] = time.perf_counter()
            if n == samples - 1:
                break
        done.wait()

    threads = [
        threading.Thread(target=follow, args=(k, c), daemon=True) for k, c in enumerate(children)
    ]
    for t in threads:
        t.start()
    event = MembershipEvent(
        kind="evicted",
        replica_id="replica-0001",
        quorum_id=42,
        reason="health: rank 7 silent for 0.70 s",
        members=tuple(f"replica-{i:04d}" for i in range(members)),
        teardown=True,
        incarnation=3,
    )
    payload = encode_event(event)
    hops = []
    try:
        for n in range(samples):
            started = time.perf_counter()
            relay.forward(payload)
            # One event at a time, as membership events come: wait for all before the next.
            while any(received[k][n] == 0.0 for k in range(FANOUT)):
                time.sleep(0)
            hops.append(max(received[k][n] for k in range(FANOUT)) - started)
        done.wait(timeout=10)
    finally:
        relay.close()
        for c in children:
            c.cancel()
    ordered = sorted(hops)
    return {
        "fanout": FANOUT,
        "samples": samples,
        "event_bytes": len(payload),
        "hop_s_p50": statistics.median(hops),
        "hop_s_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }
