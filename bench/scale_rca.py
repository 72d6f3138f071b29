"""Root-cause analysis at the job's size, over the real wire: `bench.emulation` produces the
records of an R x W job in which one rank hangs (two healthy steps, then the culprit never
enters its replica's collective and everyone else waits on it), they are sent as the agents'
`Report` batches (the real codec, the bearer token; each rank's records in order, as its agent
sends them) to the central service, and its detectors,
on their own evaluation timer, name the culprit once the hang timeout has passed (it is
raised while the records go in: see INGEST_HANG_TIMEOUT_S). Reported: the
time to produce, encode and ingest the records, and the duration of the `evaluate` that named
the culprit (the RCA time, comparable with bench.rca's in-process figure)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from fthsdp.bench.emulation import EmulatedJob, Fault, FaultKind, Record
from fthsdp.bench.scale_model import Shape, Victim
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.client_codec import ReportBatch, batch_to_pb
from fthsdp.services.health.telemetry import CollectiveRecord, Fingerprint, Heartbeat, StepRecord

REPORT = "/fthsdp.v1.HealthService/Report"
BATCH_RECORDS = 2000
"""Records per Report: the agents' `max_batch_records`."""

Evaluations = Callable[[int], list[tuple[float, float, list[dict[str, Any]]]]]
"""Asks the central process for its evaluations from an index on: (at, seconds, incidents)."""
INGEST_HANG_TIMEOUT_S = 300.0
"""The hang timeout while the records go in: the feed is slower than the job it replays (a
ring's members arrive from different streams seconds apart), so no collective may ripen before
every record is in."""


def hang_requests(shape: Shape, culprit: Victim) -> tuple[list[list[bytes]], int, float, float]:
    """The encoded batches of the hang scenario as streams, each the records of a range of
    ranks in order (as each host's agent sends its own in order); the records in them; the
    seconds spent producing and encoding them."""
    produced: list[tuple[float, Sequence[Record]]] = []
    fault = Fault(kind=FaultKind.HANG, replica=culprit.replica, rank=culprit.rank, step=2)
    started = time.perf_counter()
    job = EmulatedJob(
        replicas=shape.replicas,
        ranks=shape.ranks,
        sink=lambda now, records: produced.append((now, records)),
        seed=7,
        faults=[fault],
        intra=1,
        start=time.time(),
        ranks_per_host=shape.ranks_per_host,
    )
    job.run(3)  # two healthy steps, then the blocked one
    generate_s = time.perf_counter() - started
    started = time.perf_counter()
    per_stream = max(1, BATCH_RECORDS // 4)  # ranks per stream: ~4 records each per step
    count = 0
    streams: list[list[bytes]] = [[] for _ in range(-(-shape.total_ranks // per_stream))]
    for now, records in produced:
        split: list[list[Record]] = [[] for _ in streams]
        for r in records:
            if isinstance(r, Fingerprint):  # a replica's: with its rank 0
                flat = index(shape, r.replica_id, 0)
            else:
                flat = index(shape, r.rank.replica_id, r.rank.rank)
            split[flat // per_stream].append(r)
        for stream, mine in zip(streams, split, strict=True):
            for i in range(0, len(mine), BATCH_RECORDS):
                stream.append(_encode(mine[i : i + BATCH_RECORDS], now))
                count += len(mine[i : i + BATCH_RECORDS])
    return streams, count, generate_s, time.perf_counter() - started


def index(shape: Shape, replica_id: str, rank: int) -> int:
    """A rank's position in the job (replica-major), from its emulated replica name."""
    return int(replica_id.rsplit("-", 1)[1]) * shape.ranks + rank


def _encode(chunk: Sequence[Record], now: float) -> bytes:
    batch = ReportBatch(
        source="agent:scale-feed",
        host="scale-feed",
        heartbeats=tuple(r for r in chunk if isinstance(r, Heartbeat)),
        steps=tuple(r for r in chunk if isinstance(r, StepRecord)),
        collectives=tuple(r for r in chunk if isinstance(r, CollectiveRecord)),
        fingerprints=tuple(r for r in chunk if isinstance(r, Fingerprint)),
    )
    return bytes(batch_to_pb(batch, sent_at=now).SerializeToString())


async def send(
    central: str, token: str, streams: Sequence[Sequence[bytes]], concurrency: int, timeout_s: float
) -> tuple[int, int]:
    """Sends each stream's batches in order, `concurrency` streams at once; (acknowledged,
    failed) batches."""
    metadata = (("authorization", Token(token).header()),)
    channels = [
        grpc.aio.insecure_channel(central, options=[("grpc.enable_retries", 0), ("rca", i)])
        for i in range(4)
    ]
    calls = [
        c.unary_unary(REPORT, request_serializer=None, response_deserializer=None) for c in channels
    ]
    queue = iter(enumerate(streams))
    acked = failed = 0

    async def worker() -> None:
        nonlocal acked, failed
        for k, stream in queue:
            for data in stream:
                try:
                    await calls[k % len(calls)](data, timeout=timeout_s, metadata=metadata)
                    acked += 1
                except grpc.RpcError:
                    failed += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    for channel in channels:
        await channel.close(None)
    return acked, failed


def run_rca(
    shape: Shape,
    central: str,
    token: str,
    evaluations: Evaluations,
    hang_timeout: Callable[[float], Any],
    culprit: Victim,
    *,
    hang_timeout_s: float,
    deadline_s: float,
) -> dict[str, Any]:
    """The hang scenario at `shape` against the central service (see the module doc); the
    `hang_timeout(seconds)` of its detectors is set to `hang_timeout_s` once every record is in."""
    since = len(evaluations(0))
    streams, records, generate_s, encode_s = hang_requests(shape, culprit)
    hang_timeout(INGEST_HANG_TIMEOUT_S)
    started = time.monotonic()
    acked, failed = asyncio.run(send(central, token, streams, 8, timeout_s=30.0))
    ingested = time.monotonic()
    hang_timeout(hang_timeout_s)
    found: dict[str, int] = {}
    listed: list[dict[str, Any]] = []
    named = None
    slow: list[float] = []
    end = ingested + deadline_s
    while named is None and time.monotonic() < end:
        time.sleep(0.25)
        for at, seconds, incidents in evaluations(since):
            since += 1
            if seconds > 0.05:
                slow.append(seconds)
            for incident in incidents:
                found[incident["kind"]] = found.get(incident["kind"], 0) + 1
                if len(listed) < 20:
                    listed.append({**incident, "at_s": at - ingested})
                if (
                    incident["kind"] == "hang"
                    and incident["replica_id"] == culprit.replica_id
                    and incident["rank"] == culprit.rank
                    and named is None
                ):
                    named = (at, seconds)
    return {
        "culprit": {"replica_id": culprit.replica_id, "rank": culprit.rank},
        "records": records,
        "batches": sum(len(s) for s in streams),
        "acked_batches": acked,
        "failed_batches": failed,
        "generate_s": generate_s,
        "encode_s": encode_s,
        "ingest_s": ingested - started,
        "ingest_records_per_s": records / (ingested - started) if ingested > started else None,
        "named": named is not None,
        "rca_s": None if named is None else named[1],
        "named_after_ingest_s": None if named is None else named[0] - ingested,
        "hang_timeout_s": hang_timeout_s,
        "incidents": found,
        "incident_list": listed,
        "slow_evaluations": len(slow),
        "slowest_evaluation_s": max(slow, default=None),
        "deadline_s": deadline_s,
    }
