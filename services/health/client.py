"""`TelemetryClient`: what a training rank uses to report to the health service (its node agent,
or the central service directly). Importable by the worker: no torch, no server code.

The contract with training: a call never raises and never blocks longer than a queue put.
Records go into a bounded queue; when it is full the record is DROPPED and counted (telemetry is
worth less than a training step). A background thread sends, every `flush_interval`, everything
queued as batches of at most `max_batch` records, plus a heartbeat every `heartbeat_interval`
carrying the last step set with `set_step` (the liveness signal with progress of two-level
heartbeats: the thread beats while the rank's process runs, so a process that dies or is stopped
falls silent, while a rank stuck inside a collective keeps beating without progress and is a
hang, not a fail-stop; each heartbeat names this start of the process, so a restart is told
apart from a rank that merely went quiet). A dead or slow health service costs a failed RPC in
that thread and a jittered backoff (up to 2 s) before the next try; records queued meanwhile are
dropped once the queue is full. Invalid records (bad arguments) are dropped and counted too,
never raised, so one bad value cannot poison a batch."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import grpc

from fthsdp.protos import health_pb2 as pb
from fthsdp.protos import health_pb2_grpc as pb_grpc
from fthsdp.services.common.backoff import Retries
from fthsdp.services.common.process_ref import this_process
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.client_codec import RankRecord, add_rank_record
from fthsdp.services.health.domain import (
    MAX_BATCH_RECORDS,
    MAX_MESSAGE_BYTES,
    HealthError,
    check_id,
    check_rank,
    check_text,
)
from fthsdp.services.health.telemetry import (
    CollectiveRecord,
    Fingerprint,
    InboundLink,
    RankId,
    StepRecord,
)

__all__ = ["InboundLink", "TelemetryClient", "TelemetryStats"]
"""`InboundLink` too: what `leave_collective` takes (workers import clients only)."""

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 2.0


@dataclass(frozen=True, slots=True)
class TelemetryStats:
    """Counters of one client (a snapshot)."""

    sent_batches: int
    sent_records: int
    dropped: int
    """Records dropped: queue full, service unreachable, or invalid arguments."""
    failed_batches: int


class TelemetryClient:
    """One rank's reporter; thread-safe; start on construction, `close()` on exit."""

    def __init__(
        self,
        address: str,
        token: str | Token,
        *,
        replica_id: str,
        rank: int,
        host: str | None = None,
        heartbeat_interval: timedelta = timedelta(milliseconds=200),
        flush_interval: timedelta = timedelta(milliseconds=200),
        max_batch: int = 512,
        queue_size: int = 10_000,
        rpc_timeout: timedelta = timedelta(seconds=1),
    ) -> None:
        """Raises ValueError for bad settings (the only time this client raises)."""
        check_id(replica_id)
        check_rank(rank)
        if not 1 <= max_batch <= MAX_BATCH_RECORDS or queue_size < 1:
            raise ValueError(f"max_batch must be in 1..{MAX_BATCH_RECORDS}, queue_size >= 1")
        for value in (heartbeat_interval, flush_interval, rpc_timeout):
            if value <= timedelta(0):
                raise ValueError("intervals and rpc_timeout must be positive")
        secret = token if isinstance(token, Token) else Token(token)
        self._metadata = (("authorization", secret.header()),)
        self._rank = pb.RankRef(replica_id=replica_id, rank=rank)
        self._rank_id = RankId(replica_id=replica_id, rank=rank)
        self._host = check_text(host or socket.gethostname() or "localhost", "host")
        self._source = f"{replica_id}/{rank}"
        # Names this start of the rank in every heartbeat: a restarted rank beats with a new
        # value, which tells the service its old process is inside nothing any more.
        self._process = secrets.token_hex(8)
        # What a node agent kills if this rank's replica is torn down (its pid is checked
        # against the start time first, so a reused pid is safe).
        self._pid = this_process()
        self._heartbeat_s = heartbeat_interval.total_seconds()
        self._flush_s = flush_interval.total_seconds()
        self._max_batch = max_batch
        self._rpc_timeout = rpc_timeout.total_seconds()
        self._queue: queue.Queue[RankRecord] = queue.Queue(maxsize=queue_size)
        self._step = -1
        self._lock = threading.Lock()
        self._inflight: CollectiveRecord | None = None
        self._inflight_sent = False
        self._sent_batches = self._sent_records = self._dropped = self._failed = 0
        self._stop = threading.Event()
        self._leave_reason: str | None = None
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
                ("grpc.enable_retries", 0),
            ],
        )
        self._stub = pb_grpc.HealthServiceStub(self._channel)
        self._thread = threading.Thread(
            target=self._run, name=f"fthsdp-telemetry-{self._source}", daemon=True
        )
        self._thread.start()

    # ---- the caller's side: cheap, never raises ------------------------------------------------

    def set_step(self, step: int) -> None:
        """The rank's progress (last committed step), carried by every heartbeat."""
        if isinstance(step, int) and step >= -1:
            self._step = step

    def step(
        self,
        step: int,
        *,
        started_at: float,
        duration_s: float,
        tokens: int = 0,
        sum_seq_len_sq: int = 0,
        committed: bool = True,
        exchange_wait_s: float = 0.0,
    ) -> None:
        """One step's timing and workload (also advances the progress when committed).
        `exchange_wait_s`: of `duration_s`, the time spent waiting on the cross-replica exchange
        after this rank's own work was done."""
        if committed:
            self.set_step(step)
        self._put(
            StepRecord(
                rank=self._rank_id,
                step=step,
                started_at=started_at,
                duration_s=duration_s,
                tokens=tokens,
                sum_seq_len_sq=sum_seq_len_sq,
                committed=committed,
                exchange_wait_s=exchange_wait_s,
            )
        )

    def enter_collective(self, group: str, seq: int, op: str, *, started_at: float) -> None:
        """This rank is now inside a collective (one at a time). Nothing is queued: a collective
        still open at a flush is sent as an entry (once), and `leave_collective` queues the whole
        passage, so a collective that ends between two flushes costs one record, not two, while
        one that hangs is still seen within a flush interval."""
        record = CollectiveRecord(
            rank=self._rank_id, group=group, seq=seq, op=op, started_at=started_at
        )
        with self._lock:
            self._inflight = record
            self._inflight_sent = False

    def leave_collective(self, *, ended_at: float, inbound: InboundLink | None = None) -> None:
        """The collective entered last is over (successfully or not); `inbound`: what a ring
        exchange received from the left neighbour, for the health service's link verdicts."""
        with self._lock:
            inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self._put(dataclasses.replace(inflight, ended_at=ended_at, inbound=inbound))

    def fingerprint(self, step: int, digest: str, *, quorum_id: int = 0) -> None:
        """A digest of the replica's parameters at `step`, committed in quorum `quorum_id`
        (identical on the healthy replicas of that quorum)."""
        record = Fingerprint(
            replica_id=self._rank_id.replica_id, step=step, digest=digest, quorum_id=quorum_id
        )
        self._put(record)

    def _put(self, record: RankRecord) -> None:
        # Checked on the sending thread (`_encode`), off the caller's.
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._count_drop(1)

    def _count_drop(self, count: int) -> None:
        with self._lock:
            self._dropped += count

    @property
    def stats(self) -> TelemetryStats:
        """Counters so far."""
        with self._lock:
            return TelemetryStats(
                self._sent_batches, self._sent_records, self._dropped, self._failed
            )

    def close(
        self, timeout: timedelta = timedelta(seconds=1), *, leave: bool = True, reason: str = ""
    ) -> None:
        """Flushes what is queued (within `timeout`) and stops. With `leave`, tells the service
        this rank exits cleanly, so its silence is no incident. Idempotent; never raises."""
        if self._stop.is_set():
            return
        self._leave_reason = reason[:1024] if leave else None
        self._stop.set()
        self._thread.join(timeout.total_seconds() + self._rpc_timeout)
        with contextlib.suppress(Exception):
            self._channel.close()

    def __enter__(self) -> TelemetryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the background thread ----------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        retry_at = 0.0
        retries = Retries.after(self._flush_s, _MAX_BACKOFF_S)
        while not self._stop.wait(self._flush_s):
            now = time.monotonic()
            beat = now >= next_beat
            if beat:
                next_beat = now + self._heartbeat_s
            if now < retry_at:
                continue  # backing off: the queue fills and drops; heartbeats are skipped
            if self._flush(beat):
                retries.succeeded()
            else:
                retry_at = time.monotonic() + retries.failed()
        with contextlib.suppress(Exception):
            self._flush(beat=True, final=True)

    def _flush(self, beat: bool, final: bool = False) -> bool:
        """Sends everything queued (and a heartbeat); False when a send failed."""
        while True:
            request = self._take(beat, final)
            if request is None:
                return True
            if not self._send(request):
                return False
            beat = False
            if self._queue.empty() and not final:
                return True

    def _take(self, beat: bool, final: bool) -> pb.ReportRequest | None:
        request = pb.ReportRequest(source=self._source, host=self._host)
        taken = 0
        while taken < self._max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            taken += 1
            if not self._encode(request, item):
                self._count_drop(1)
        entry = self._unsent_entry()
        if entry is not None:
            taken += 1
            if not self._encode(request, entry):
                self._count_drop(1)
        if beat:
            hb = request.heartbeats.add(
                step=self._step,
                at=time.time(),
                process=self._process,
                pid=self._pid.pid,
                pid_start=self._pid.start,
            )
            hb.rank.CopyFrom(self._rank)
        if final and self._leave_reason is not None and self._queue.empty():
            request.left.add(rank=self._rank, reason=self._leave_reason)
            self._leave_reason = None
        if not (taken or beat or len(request.left)):
            return None
        request.sent_at = time.time()
        return request

    def _unsent_entry(self) -> CollectiveRecord | None:
        """The open collective, if its entry has not been sent yet (it is marked sent)."""
        with self._lock:
            if self._inflight is None or self._inflight_sent:
                return None
            self._inflight_sent = True
            return self._inflight

    @staticmethod
    def _encode(request: pb.ReportRequest, record: RankRecord) -> bool:
        """Adds one queued record; False (dropped) when the service would refuse it."""
        try:
            add_rank_record(request, record)
        except (HealthError, TypeError, ValueError):
            return False
        return True

    def _send(self, request: pb.ReportRequest) -> bool:
        records = (
            len(request.steps)
            + len(request.collectives)
            + len(request.fingerprints)
            + len(request.heartbeats)
        )
        try:
            self._stub.Report(request, timeout=self._rpc_timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            log.debug("telemetry send failed: %s", code)
            with self._lock:
                self._failed += 1
                self._dropped += records - len(request.heartbeats)
            return False
        with self._lock:
            self._sent_batches += 1
            self._sent_records += records
        return True
