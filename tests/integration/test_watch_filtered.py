"""A Watch stream filtered to some replicas (a node agent's: its host's replicas) on a real
quorum service: its snapshot lists those registered with their incarnations, and it gets their
joins, leaves and evictions in order, nothing about other replicas and no quorum events, while a
plain stream beside it gets everything. Bad filters are refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from fthsdp.services.quorum.client import (
    MAX_WATCHED_REPLICAS,
    InvalidRequestError,
    QuorumClient,
    RankEndpoint,
)
from fthsdp.services.quorum.server import QuorumServerThread

_RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")


def test_a_filtered_stream_gets_only_its_replicas_events(
    quorum_thread: QuorumServerThread, token: str
) -> None:
    client = QuorumClient(quorum_thread.address, token)
    r0 = client.join("r0", [_RANK])
    r2 = client.join("r2", [_RANK])
    mine = client.watch(timeout=timedelta(seconds=20), replicas=("r1", "r2", "r9"))
    every = client.watch(timeout=timedelta(seconds=20))
    try:
        snapshot = next(mine)
        assert snapshot.kind == "snapshot"
        assert (snapshot.members, snapshot.incarnations) == (("r2",), (r2,))
        full = next(every)
        assert full.members == ("r0", "r2") and full.incarnations == ()

        r1 = client.join("r1", [_RANK])
        with ThreadPoolExecutor(3) as pool:  # a quorum of all three forms
            asks = [
                pool.submit(client.quorum, r, i, 0, timeout=timedelta(seconds=10))
                for r, i in (("r0", r0), ("r1", r1), ("r2", r2))
            ]
            assert all(len(a.result(timeout=15).members) == 3 for a in asks)
        client.report_failure("r0", "dead", reporter="test", teardown=True)
        client.report_failure("r2", "dead", reporter="test", teardown=True)
        client.leave("r1", r1, "done")

        assert [(e.kind, e.replica_id) for e in (next(every) for _ in range(5))] == [
            ("joined", "r1"),
            ("quorum", None),
            ("evicted", "r0"),
            ("evicted", "r2"),
            ("left", "r1"),
        ]
        got = [
            (e.kind, e.replica_id, e.incarnation, e.teardown)
            for e in (next(mine) for _ in range(3))
        ]
        assert got == [
            ("joined", "r1", r1, False),
            ("evicted", "r2", r2, True),
            ("left", "r1", r1, False),
        ]
    finally:
        mine.cancel()
        every.cancel()
        client.close()


@pytest.mark.parametrize(
    "replicas",
    [
        tuple(f"r{i}" for i in range(MAX_WATCHED_REPLICAS + 1)),
        ("r0", "bad id"),
        ("r0", ""),
    ],
)
def test_a_bad_filter_is_refused(
    quorum_thread: QuorumServerThread, token: str, replicas: tuple[str, ...]
) -> None:
    client = QuorumClient(quorum_thread.address, token)
    try:
        stream = client.watch(timeout=timedelta(seconds=5), replicas=replicas)
        with pytest.raises(InvalidRequestError):
            next(stream)
    finally:
        client.close()
