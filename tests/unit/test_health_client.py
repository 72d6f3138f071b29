"""TelemetryClient against a real local gRPC ingest server: batching, heartbeats with progress,
bounded queue that drops (and counts) instead of blocking, a dead service that costs the caller
nothing, and the clean-exit notice."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from fthsdp.services.health.client import TelemetryClient
from fthsdp.services.health.server import IngestServer
from fthsdp.services.health.telemetry import InboundLink
from tests.ingest_support import RecordingSink, ingest_server


@pytest.fixture
async def sink_server(token: str) -> AsyncIterator[tuple[RecordingSink, IngestServer]]:
    async with ingest_server(token) as served:
        yield served


async def _until(check: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_records_arrive_batched_with_heartbeats_carrying_progress(
    sink_server: tuple[RecordingSink, IngestServer], token: str
) -> None:
    sink, server = sink_server
    client = TelemetryClient(
        server.address, token, replica_id="r0", rank=2, host="h1", max_batch=64
    )
    try:
        now = time.time()
        for step in range(200):
            client.step(step, started_at=now, duration_s=0.01, tokens=8, sum_seq_len_sq=64)
        client.enter_collective("replica:r0", 1, "allreduce", started_at=now)
        client.fingerprint(199, "abc")

        def all_arrived() -> bool:
            return sum(len(b.steps) for b in sink.batches) == 200 and any(
                b.fingerprints for b in sink.batches
            )

        await _until(all_arrived)
        steps = [s for b in sink.batches for s in b.steps]
        assert [s.step for s in steps] == list(range(200))
        assert max(len(b.steps) for b in sink.batches) <= 64  # batched, bounded
        assert len(sink.batches) < 50  # not one RPC per record
        await _until(lambda: any(h.step == 199 for b in sink.batches for h in b.heartbeats))
        beat = next(h for b in sink.batches for h in b.heartbeats if h.step == 199)
        assert (beat.rank.replica_id, beat.rank.rank, beat.host) == ("r0", 2, "h1")
        assert sum(len(b.collectives) for b in sink.batches) == 1
        assert client.stats.dropped == 0
    finally:
        await asyncio.to_thread(client.close)
    assert sink.batches[-1].left[0].replica_id == "r0"  # the clean-exit notice


async def test_a_collective_over_between_flushes_is_one_record_an_open_one_is_announced(
    sink_server: tuple[RecordingSink, IngestServer], token: str
) -> None:
    sink, server = sink_server
    # No flush before close: every collective below opens and closes between two flushes.
    quiet = TelemetryClient(
        server.address, token, replica_id="r0", rank=0, flush_interval=timedelta(seconds=60)
    )
    for seq in range(50):
        quiet.enter_collective("ftar:1:0", seq, "allreduce", started_at=100.0 + seq)
        inbound = InboundLink(sender_replica="r2", bytes=1000 + seq, busy_s=0.25)
        quiet.leave_collective(ended_at=100.5 + seq, inbound=inbound if seq % 2 else None)
    await asyncio.to_thread(quiet.close)
    passages = [c for b in sink.batches for c in b.collectives]
    # (The service shifts times by the sender's clock offset: compare durations.)
    assert [c.seq for c in passages] == list(range(50))
    assert [c.inbound for c in passages[:2]] == [
        None,
        InboundLink(sender_replica="r2", bytes=1001, busy_s=0.25),
    ]
    assert all(c.ended_at is not None for c in passages)
    assert [round(c.ended_at - c.started_at, 3) for c in passages if c.ended_at] == [0.5] * 50

    sink.batches.clear()
    client = TelemetryClient(
        server.address, token, replica_id="r0", rank=1, flush_interval=timedelta(milliseconds=20)
    )
    try:
        client.enter_collective("ftar:2:1", 7, "allreduce", started_at=200.0)

        def records() -> list[tuple[int, float | None]]:
            return [
                (c.seq, None if c.ended_at is None else round(c.ended_at - c.started_at, 3))
                for b in sink.batches
                for c in b.collectives
                if c.rank.rank == 1
            ]

        await _until(lambda: records() == [(7, None)])  # still open: the entry, once
        client.leave_collective(ended_at=201.0)
        await _until(lambda: len(records()) == 2)
        assert records() == [(7, None), (7, 1.0)]
        client.leave_collective(ended_at=202.0)  # nothing open: nothing sent
    finally:
        await asyncio.to_thread(client.close)
    assert len(records()) == 2


async def test_a_full_queue_drops_and_counts_without_blocking(
    sink_server: tuple[RecordingSink, IngestServer], token: str
) -> None:
    sink, server = sink_server
    sink.gate.clear()  # the service accepts nothing: every send hangs until its deadline
    client = TelemetryClient(
        server.address,
        token,
        replica_id="r0",
        rank=0,
        queue_size=100,
        rpc_timeout=timedelta(seconds=30),
    )
    try:
        started = time.perf_counter()
        for step in range(1000):
            client.step(step, started_at=1.0, duration_s=0.1)
        elapsed = time.perf_counter() - started
        # The bound is the property: a caller that waited on the hanging send even once would
        # take a whole RPC timeout (30 s); 1000 calls that never wait take milliseconds.
        assert elapsed < 15.0, f"1000 calls took {elapsed:.3f} s: a call waited on the send"
        assert client.stats.dropped >= 800
        client.step(-5, started_at=1.0, duration_s=0.1)  # invalid: dropped, never raised
    finally:
        sink.gate.set()
        await asyncio.to_thread(client.close)


async def test_a_dead_service_costs_the_caller_nothing(token: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    client = TelemetryClient(f"127.0.0.1:{port}", token, replica_id="r0", rank=0, queue_size=50)
    try:
        for step in range(500):
            client.set_step(step)
            client.step(step, started_at=1.0, duration_s=0.1)
            client.fingerprint(step, "d")
        assert client.stats.dropped >= 1000 - 50  # the queue bound held; nothing raised
        await _until(lambda: client.stats.failed_batches >= 1)
        assert client.stats.sent_batches == 0
    finally:
        started = time.perf_counter()
        await asyncio.to_thread(client.close, timedelta(milliseconds=200))
        assert time.perf_counter() - started < 3.0


def test_bad_settings_raise_at_construction_only(token: str) -> None:
    with pytest.raises(ValueError):
        TelemetryClient("127.0.0.1:1", token, replica_id="a b", rank=0)
    with pytest.raises(ValueError):
        TelemetryClient("127.0.0.1:1", token, replica_id="r0", rank=0, max_batch=0)
