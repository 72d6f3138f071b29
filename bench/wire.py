"""Telemetry ingest of the central health service over the real wire, next to HealthCore alone.

The service: a central `HealthProcess` (in-memory store, its evaluate loop running, no HTTP) started
on port 0 in a thread of the benchmark process, on that thread's own event loop. The main thread
only waits meanwhile, so the service has this process's GIL to itself; a child process would cost
one more interpreter on a 2-core machine for nothing.

The clients: K spawned processes (not forked: gRPC already runs in the parent), each a node
agent of one emulated job (bench.emulation, disjoint replicas per client, shared FTAR rings),
calling `fthsdp.v1.HealthService/Report` with the bearer token, one batch in flight each. Every
batch holds B step and collective records. Before the clock starts each client emulates its whole
stream and serializes it (protobuf bytes, sent as they are), so during the run the clients spend
their CPU on gRPC calls, not on emulation. Counted: the records and batches the service
acknowledged (`ReportResponse.accepted`), cross-checked with the service's own records counter;
latency is per call, send to acknowledgement.

The reference rows measure, in this process before the service starts, the same kind of
batches fed to HealthCore directly, and decoded from protobuf first (what the handler does), so
the wire's cost shows as a ratio."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

import grpc

from fthsdp.bench.emulation import EmulatedJob, Record
from fthsdp.protos import health_pb2 as pb
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.client_codec import batch_from_pb
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.process import HealthProcess
from fthsdp.services.health.telemetry import CollectiveRecord, StepRecord

REPORT = "/fthsdp.v1.HealthService/Report"
REPLICAS_PER_CLIENT = 4
RANKS_PER_REPLICA = 64
RPC_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True, slots=True)
class WireSpec:
    """One wire run."""

    clients: int = 2
    """K: client processes."""
    batch: int = 512
    """B: records per batch."""
    duration_s: float = 5.0
    """How long every client sends."""
    stream_records: int = 300_000
    """Records each client emulates beforehand; a client that runs out stops early (reported)."""


# ---- the record stream ------------------------------------------------------------------------


def job_batches(client: int, batch: int, steps: int) -> Iterator[tuple[float, list[Record]]]:
    """Client `client`'s emulated records, B at a time: (virtual time of the last, records)."""
    chunks: list[tuple[float, list[Record]]] = []

    def sink(now: float, records: Sequence[Record]) -> None:
        kept: list[Record] = [r for r in records if isinstance(r, StepRecord | CollectiveRecord)]
        chunks.append((now, kept))

    job = EmulatedJob(
        replicas=REPLICAS_PER_CLIENT,
        ranks=RANKS_PER_REPLICA,
        sink=sink,
        seed=client,
        start=time.time(),
        first_replica=client * REPLICAS_PER_CLIENT,
    )
    pending: list[Record] = []
    for _ in range(steps):
        job.step()
        for now, records in chunks:
            pending += records
            while len(pending) >= batch:
                yield now, pending[:batch]
                del pending[:batch]
        chunks.clear()


def records_per_step() -> int:
    """Step and collective records one client's job emits per step (intra x2, ring, step)."""
    return REPLICAS_PER_CLIENT * RANKS_PER_REPLICA * 4


def to_request(source: str, sent_at: float, records: Sequence[Record]) -> pb.ReportRequest:
    """A node agent's batch: `sent_at` is the emulated clock, so the service rebases the times."""
    request = pb.ReportRequest(source=f"agent:{source}", host=source, sent_at=sent_at)
    for r in records:
        if isinstance(r, StepRecord):
            s = request.steps.add(
                step=r.step,
                started_at=r.started_at,
                duration_s=r.duration_s,
                tokens=r.tokens,
                sum_seq_len_sq=r.sum_seq_len_sq,
                committed=r.committed,
                exchange_wait_s=r.exchange_wait_s,
            )
            s.rank.replica_id, s.rank.rank = r.rank.replica_id, r.rank.rank
        elif isinstance(r, CollectiveRecord):
            c = request.collectives.add(group=r.group, seq=r.seq, op=r.op, started_at=r.started_at)
            if r.ended_at is not None:
                c.ended_at = r.ended_at
            c.rank.replica_id, c.rank.rank = r.rank.replica_id, r.rank.rank
    return request


# ---- in-process reference ---------------------------------------------------------------------


def in_process(batch: int, records: int) -> dict[str, Any]:
    """Records/s of the same kind of batches into HealthCore: directly, and decoded first."""
    steps = max(2, math.ceil(records / records_per_step()))
    stream = list(job_batches(0, batch, steps))
    encoded = [to_request("ref", now, recs).SerializeToString() for now, recs in stream]
    count = sum(len(recs) for _, recs in stream)
    core = HealthCore(DetectorConfig())
    started = time.perf_counter()
    for _, recs in stream:
        core.steps([r for r in recs if isinstance(r, StepRecord)])
        core.collectives([r for r in recs if isinstance(r, CollectiveRecord)])
    direct_s = time.perf_counter() - started
    core = HealthCore(DetectorConfig())
    started = time.perf_counter()
    for data in encoded:
        decoded = batch_from_pb(pb.ReportRequest.FromString(data), time.time())
        core.steps(decoded.steps)
        core.collectives(decoded.collectives)
    decoded_s = time.perf_counter() - started
    return {
        "records": count,
        "batches": len(stream),
        "direct_records_per_s": count / direct_s,
        "direct_batches_per_s": len(stream) / direct_s,
        "decoded_records_per_s": count / decoded_s,
        "decoded_batches_per_s": len(stream) / decoded_s,
    }


# ---- the service ------------------------------------------------------------------------------


class ServiceThread:
    """A central HealthProcess on its own event loop in a thread; `start()` returns its address."""

    def __init__(self, token: Token) -> None:
        self._token = token
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.node: HealthProcess | None = None
        self._thread = threading.Thread(target=self._run, name="fthsdp-bench-health", daemon=True)

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(STARTUP_TIMEOUT_S) or self.node is None:
            raise RuntimeError(f"the health service did not start: {self._error!r}")
        return self.node.grpc_address

    def stop(self) -> None:
        if self._loop is not None and self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(STARTUP_TIMEOUT_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        config = HealthConfig(port=0, http_port=None, shutdown_grace=timedelta(seconds=1))
        node = HealthProcess(config, self._token)
        await node.start()
        self.node = node
        self._ready.set()
        try:
            await self._done.wait()
        finally:
            await node.stop()

    def counted(self) -> tuple[int, int]:
        """(records, incidents) the service counted, by its own metrics (after `stop`)."""
        assert self.node is not None
        metrics = self.node.metrics
        return _counter_total(metrics.records), _counter_total(metrics.incidents)


def _counter_total(counter: Any) -> int:
    return int(
        sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
    )


# ---- the clients ------------------------------------------------------------------------------


def client_main(
    client: int, address: str, token: str, spec_json: str, go: Event, conn: Connection
) -> None:
    """One client process: emulate and encode the stream, say ready, wait for go, send, report."""
    spec = WireSpec(**json.loads(spec_json))
    steps = max(1, math.ceil(spec.stream_records / records_per_step()))
    name = f"bench-{client}"
    stream = [
        (len(recs), to_request(name, now, recs).SerializeToString())
        for now, recs in job_batches(client, spec.batch, steps)
    ]
    metadata = (("authorization", Token(token).header()),)
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=STARTUP_TIMEOUT_S)
        # Bytes as they are: the request was serialized before the clock started.
        report = channel.unary_unary(
            REPORT, request_serializer=None, response_deserializer=pb.ReportResponse.FromString
        )
        conn.send_bytes(b"ready")
        if not go.wait(STARTUP_TIMEOUT_S):
            return
        result = _send(report, metadata, stream, spec.duration_s)
    conn.send_bytes(json.dumps(result).encode())
    conn.close()


def _send(
    report: Any, metadata: Any, stream: list[tuple[int, bytes]], duration_s: float
) -> dict[str, Any]:
    latencies: list[float] = []
    records = batches = failed = 0
    started = time.monotonic()
    deadline = started + duration_s
    last = started
    exhausted = True
    for _, data in stream:
        if time.monotonic() >= deadline:
            exhausted = False
            break
        sent = time.perf_counter()
        try:
            response = report(data, timeout=RPC_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError:
            failed += 1
            continue
        latencies.append(time.perf_counter() - sent)
        last = time.monotonic()
        records += response.accepted
        batches += 1
    return {
        "records": records,
        "batches": batches,
        "failed": failed,
        "started": started,
        "last_ack": last,
        "exhausted": exhausted,
        "latencies": latencies,
    }


def over_the_wire(spec: WireSpec) -> dict[str, Any]:
    """The wire run: records and batches acknowledged per second, latency percentiles."""
    token = Token(secrets.token_urlsafe(32))
    service = ServiceThread(token)
    address = service.start()
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    procs, conns = [], []
    try:
        for k in range(spec.clients):
            mine, theirs = ctx.Pipe(duplex=False)
            args = (k, address, token.value, json.dumps(_spec_dict(spec)), go, theirs)
            proc = ctx.Process(target=client_main, args=args, name=f"fthsdp-bench-client-{k}")
            proc.start()
            procs.append(proc)
            conns.append(mine)
            theirs.close()
        for conn, proc in zip(conns, procs, strict=True):
            _receive(conn, proc, STARTUP_TIMEOUT_S)  # b"ready": its stream is encoded
        go.set()
        results = [
            json.loads(_receive(conn, proc, spec.duration_s + STARTUP_TIMEOUT_S))
            for conn, proc in zip(conns, procs, strict=True)
        ]
    finally:
        go.set()  # a client still waiting returns at once
        for proc in procs:
            proc.join(RPC_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
        service.stop()
    counted, incidents = service.counted()
    return _summary(spec, results, counted, incidents)


def _receive(conn: Connection, proc: BaseProcess, timeout_s: float) -> bytes:
    """The client's next message; RuntimeError when it died or stayed silent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            return conn.recv_bytes()
        if not proc.is_alive() and not conn.poll(0):
            raise RuntimeError(f"{proc.name} exited ({proc.exitcode}) without reporting")
    raise RuntimeError(f"{proc.name} reported nothing within {timeout_s:.0f} s")


def _spec_dict(spec: WireSpec) -> dict[str, Any]:
    return {
        "clients": spec.clients,
        "batch": spec.batch,
        "duration_s": spec.duration_s,
        "stream_records": spec.stream_records,
    }


def _summary(
    spec: WireSpec, results: list[dict[str, Any]], counted: int, incidents: int
) -> dict[str, Any]:
    window = max(r["last_ack"] for r in results) - min(r["started"] for r in results)
    records = sum(r["records"] for r in results)
    batches = sum(r["batches"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies"])
    return {
        **_spec_dict(spec),
        "service": "central HealthProcess, thread of the benchmark process (own event loop)",
        "window_s": window,
        "records": records,
        "batches": batches,
        "failed_batches": sum(r["failed"] for r in results),
        "service_counted_records": counted,
        "incidents": incidents,
        "exhausted_clients": sum(r["exhausted"] for r in results),
        "records_per_s": records / window if window > 0 else float("nan"),
        "batches_per_s": batches / window if window > 0 else float("nan"),
        "latency_p50_s": _percentile(latencies, 0.50),
        "latency_p99_s": _percentile(latencies, 0.99),
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]
