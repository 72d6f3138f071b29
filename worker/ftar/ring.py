"""FtarRing: one rank's place in a fault-tolerant ring (listener, connections, comm thread).

Connection scheme: every rank *connects to its right neighbour* and *accepts from its left*; the
connection to the right carries this rank's data (and READY back), the accepted one carries the
left's data. Before anything else, both ends prove they hold the job's ring key
(``worker.ftar.auth``: a challenge from the acceptor, proofs in HELLO and ACK); a connection
without a valid proof is closed unread. A HELLO names the connector's epoch, ring position, ring
size and own address; the
acceptor admits it only as the expected left neighbour of its current epoch, answers STALE to an
older epoch, WRONG_PEER to anything else in its epoch, and parks a HELLO from a newer epoch until
its own ``reconfigure`` reaches it (so neighbours may reconfigure in any order). Once an exchange,
a reconfigure or an ``abort`` has failed the current epoch, the acceptor answers EPOCH_FAILED
until its next ``reconfigure``: it cannot exchange in that epoch again before then, and its
replica's vote has failed, so a neighbour that connected now would wait in an exchange nobody
joins (the retry happens on a new quorum, with a new epoch).

``reconfigure`` keeps a connection when the neighbour on that side is the same address and the
socket is still healthy (steady state and a new epoch with unchanged neighbours reuse sockets; the
epoch is then checked by every exchange header). The two ends decide alone, so a neighbour may
drop a connection an instant after this rank kept it: this rank's first exchange then fails on
it, and the neighbour, awaiting a fresh connection from its left, gives the epoch up as soon as
its own right connection closes. Any failed exchange closes both connections at once, which
also tells the neighbours fast, and latches the ring as broken until the next ``reconfigure``.
``abort`` shuts the sockets down, which wakes every blocked thread immediately.

Threads: the caller's (allreduce/reconfigure/abort), the acceptor, and the comm, sender and
receiver threads of :mod:`worker.ftar.engine`. ``allreduce`` and ``reconfigure`` must not run
concurrently with each other (the Manager serializes them); ``abort``, ``close`` and ``stats`` are
safe from any thread.

The ring is one object in parts, each a mixin over the state of :mod:`worker.ftar.ring_state`:
this module (construction and the public API), :mod:`worker.ftar.acceptor` (the accept loop,
the handshake and admission), :mod:`worker.ftar.reconfigure` (joining a new ring) and
:mod:`worker.ftar.ring_steps` (the comm thread and each exchange's chunk loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fthsdp.worker.ftar import codec, conn, wire
from fthsdp.worker.ftar.config import FtarConfig
from fthsdp.worker.ftar.engine import Event, receiver_loop, sender_loop
from fthsdp.worker.ftar.errors import (
    FatalFtarError,
    FtarAbortedError,
    FtarError,
    RecoverableFtarError,
)
from fthsdp.worker.ftar.reconfigure import Reconfigurer
from fthsdp.worker.ftar.ring_state import Counters, WorkItem
from fthsdp.worker.ftar.ring_steps import RingSteps
from fthsdp.worker.ftar.staging import (
    CudaPools,
    CudaStage,
    DirectStage,
    HostBuffer,
    HostStage,
    Stage,
)
from fthsdp.worker.ftar.work import FtarWork

__all__ = ["FtarRing", "FtarStats"]

log = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_NUMEL = 1 << 40


@dataclass(frozen=True, slots=True)
class FtarStats:
    """Counters of one ring since construction (for tests, benchmarks and telemetry)."""

    epoch: int | None
    ring_size: int
    connects: int
    accepts: int
    exchanges_ok: int
    exchanges_failed: int
    bytes_sent: int
    """Data-phase bytes (chunk tags + payload) sent to the right neighbour."""
    bytes_received: int
    """Data-phase bytes (chunk tags + payload) received from the left neighbour."""
    receive_busy_s: float
    """Seconds spent receiving chunk payloads from the left neighbour (see `engine.Inbound`):
    the link's share of the exchanges."""


class FtarRing(Reconfigurer, RingSteps):
    """This rank's fault-tolerant ring allreduce endpoint.

    Construction binds the listener (``.address`` is ready to publish); ``reconfigure`` joins a
    ring; ``allreduce`` enqueues exchanges processed in FIFO order by the comm thread.
    """

    def __init__(self, config: FtarConfig | None = None) -> None:
        self.config = config or FtarConfig()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        try:
            self._listener = conn.listen(
                self.config.bind_host, self.config.port, self.config.socket_buffer_bytes
            )
        except OSError as exc:
            raise FatalFtarError(
                f"cannot listen on {self.config.bind_host}:{self.config.port}: {exc}"
            ) from exc
        self.address = conn.format_address(self.config.bind_host, self._listener.getsockname()[1])
        self._topo = None
        self._in = None
        self._out = None
        self._connecting = None
        self._parked = []
        self._graveyard = []
        self._gen = 0
        self._dead_epoch = -1
        self._halted = FtarAbortedError("ring not configured yet")
        self._admitting = False
        self._fatal = None
        self._closed = False
        self._pending = 0
        self._xid = 0
        self._counters = Counters()
        self._host = HostBuffer()
        self._cuda = CudaPools()
        self._slots = []
        self._slot_views = []
        self._work_q = queue.SimpleQueue()
        self._events = queue.SimpleQueue()
        self._send_q = queue.SimpleQueue()
        self._recv_q = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._accept_loop, name=f"ftar-accept-{self.address}"),
            threading.Thread(target=self._comm_loop, name=f"ftar-comm-{self.address}"),
            threading.Thread(
                target=sender_loop,
                name=f"ftar-send-{self.address}",
                args=(self._send_q, self._events, self._counters.sent),
            ),
            threading.Thread(
                target=receiver_loop,
                name=f"ftar-recv-{self.address}",
                args=(self._recv_q, self._events, self._counters.received),
            ),
        ]
        for t in self._threads:
            t.daemon = True
            t.start()
        log.info("ftar ring listening", extra=self._ctx())

    # ------------------------------------------------------------------ public API

    @property
    def epoch(self) -> int | None:
        """The epoch of the last ``reconfigure`` (None before the first)."""
        topo = self._topo
        return topo.epoch if topo else None

    @property
    def broken(self) -> bool:
        """True if the next exchange cannot succeed without ``reconfigure``: not configured yet,
        aborted, a failed exchange, a fatal error, or a neighbour connection found closed.

        Cheap (two non-blocking socket probes); meant for "skip reconfigure if the epoch is
        unchanged and the ring is not broken" at the start of a step.
        """
        with self._lock:
            return self._broken_locked()

    def _broken_locked(self) -> bool:
        if self._halted is not None or self._fatal is not None or self._closed:
            return True
        topo = self._topo
        if topo is None or topo.size == 1:
            return topo is None
        return not all(c is not None and conn.is_alive(c.sock) for c in (self._in, self._out))

    def stats(self) -> FtarStats:
        """A snapshot of the ring's counters."""
        c, topo = self._counters, self._topo
        return FtarStats(
            epoch=topo.epoch if topo else None,
            ring_size=topo.size if topo else 0,
            connects=c.connects,
            accepts=c.accepts,
            exchanges_ok=c.ok,
            exchanges_failed=c.failed,
            bytes_sent=c.sent[0],
            bytes_received=c.received.bytes,
            receive_busy_s=c.received.busy_s,
        )

    def reconfigure(self, peers: Sequence[str], my_index: int, epoch: int) -> None:
        """Join the ring ``peers`` (listener addresses in ring order) at ``my_index``. A rank
        connects only to its two neighbours, so the other peers may be ``""`` where this rank
        does not know them (the quorum service tells each rank only its neighbours').

        Blocks until both neighbour connections are up (at most ``connect_timeout``); keeps
        connections whose neighbour did not change. Same epoch and same ring: no-op while healthy,
        reconnect if broken. Raises FatalFtarError for bad arguments, an epoch that goes back or a
        changed ring under the same epoch; RecoverableFtarError if a neighbour cannot be reached
        in time, is at a newer epoch, or ``abort``/``close`` interrupts.
        """
        topo = self._validate_ring(peers, my_index, epoch)
        with self._lock:
            self._check_usable()
            cur = self._topo
            if cur and epoch == cur.epoch and not self._broken_locked():
                return  # same epoch implies the same ring (checked by _validate_ring)
        deadline = time.monotonic() + self.config.connect_timeout.total_seconds()
        self._drain(deadline)
        with self._lock:
            self._check_usable()
            if epoch <= self._dead_epoch:
                raise FtarAbortedError(f"epoch {epoch} was aborted: a member of it is gone")
            gen = self._gen
            kept = self._install(topo)
        try:
            if topo.size > 1:
                if not kept[1]:
                    self._connect_right(topo, gen, deadline)
                self._await_left(topo, gen, deadline)
        except FtarError as exc:
            with self._lock:
                if isinstance(exc, RecoverableFtarError) and self._gen == gen:
                    self._halted = exc
                self._admitting = False
            log.warning("ftar reconfigure failed: %s", exc, extra=self._ctx())
            raise
        with self._lock:
            if self._gen != gen:
                raise FtarAbortedError("aborted during reconfigure")
            self._halted = None
        log.info("ftar ring reconfigured (kept left=%s right=%s)", *kept, extra=self._ctx())

    def allreduce(
        self, tensors: Sequence[torch.Tensor], *, contribute: bool = True, num_contributors: int
    ) -> FtarWork:
        """Enqueue an average of ``tensors`` across the ring; results land in them in place.

        The result is the sum over contributing members divided by ``num_contributors`` (the
        caller's count of contributors). ``contribute=False`` counts this rank's input as zeros
        and never reads it. Argument errors raise FatalFtarError at once; exchange failures are
        latched in the returned work. Until the work is done the tensors belong to the ring.
        """
        tensors = list(tensors)
        device = _validate_tensors(tensors)
        if not isinstance(contribute, bool):
            raise FatalFtarError("contribute must be a bool")
        with self._lock:
            self._check_usable()
            topo = self._topo
            if topo is None:
                raise FatalFtarError("allreduce before the first reconfigure")
            if not isinstance(num_contributors, int) or not 1 <= num_contributors <= topo.size:
                raise FatalFtarError(
                    f"num_contributors must be in [1, {topo.size}], got {num_contributors!r}"
                )
        work = FtarWork(tensors, device)
        stage = self._make_stage(tensors, device, contribute)
        item = WorkItem(work, stage, contribute, num_contributors, wire.layout_digest(tensors), 0)
        with self._lock:
            if self._halted is not None:
                stage.release()
                work._finish(self._halted)
                return work
            item.gen = self._gen
            self._pending += 1
            self._work_q.put(item)
        return work

    def abort(self, reason: str = "aborted", *, epoch: int | None = None) -> None:
        """Fail in-flight and queued work (FtarAbortedError) and unblock every wait now.

        Thread-safe and idempotent. The ring stays unusable until the next ``reconfigure``.
        With ``epoch``, that epoch and every older one stay aborted: a ``reconfigure`` to one
        of them that has not started yet fails at once instead of waiting for a member that
        is gone (the caller knows one is); and a ring already at a newer epoch (reconfiguring
        or exchanging) is left alone, since nothing of the aborted epochs is in flight.
        """
        with self._lock:
            if self._closed:
                return
            if epoch is not None:
                self._dead_epoch = max(self._dead_epoch, epoch)
                topo = self._topo
                if topo is not None and topo.epoch > epoch:
                    return
            self._gen += 1
            self._halted = FtarAbortedError(reason)
            self._admitting = False
            self._bury_conns()
            if self._connecting is not None:
                conn.shutdown_quietly(self._connecting)
            self._cv.notify_all()
        self._events.put(Event("wake", -1))
        log.info("ftar ring aborted: %s", reason, extra=self._ctx())

    def close(self) -> None:
        """Abort, stop every thread and release every socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._gen += 1
            self._halted = FtarAbortedError("ring closed")
            self._bury_conns()
            if self._connecting is not None:
                conn.shutdown_quietly(self._connecting)
            for sock, _, _ in self._parked:
                conn.close_quietly(sock)
            self._parked.clear()
            self._cv.notify_all()
        conn.shutdown_quietly(self._listener)
        self._events.put(Event("wake", -1))
        self._work_q.put(None)
        # Every thread, the sender and receiver too (the comm loop's exit stops them): none of
        # them may still be running when the process exits.
        for t in self._threads:
            t.join(timeout=10)
        with self._lock:
            self._flush_graveyard()
        conn.close_quietly(self._listener)
        log.info("ftar ring closed", extra=self._ctx())

    def __enter__(self) -> FtarRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers of the API

    def _check_usable(self) -> None:
        if self._closed:
            raise FatalFtarError("ring is closed")
        if self._fatal is not None:
            raise self._fatal

    def _make_stage(
        self, tensors: list[torch.Tensor], device: torch.device, contribute: bool
    ) -> Stage:
        dtype = codec.ring_dtype(self.config.wire_compression)
        if device.type == "cuda":
            return CudaStage(tensors, self._cuda, contribute=contribute, dtype=dtype)
        if all(t.dtype == dtype for t in tensors):
            return DirectStage(tensors)
        return HostStage(tensors, self._host, dtype)

    def _drain(self, deadline: float) -> None:
        """Supersede queued/in-flight work and wait for the comm thread to go idle."""
        with self._lock:
            busy = self._pending > 0
        if busy:
            self.abort("superseded by reconfigure")
        with self._cv:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FatalFtarError("comm thread did not go idle after abort")
                self._cv.wait(left)
            self._flush_graveyard()


def _validate_tensors(tensors: list[torch.Tensor]) -> torch.device:
    if not tensors:
        raise FatalFtarError("allreduce needs at least one tensor")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise FatalFtarError("allreduce takes a sequence of torch.Tensor")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device:
            raise FatalFtarError(f"tensor {i} is on {t.device}, tensor 0 on {device}")
        if t.dtype not in _DTYPES:
            raise FatalFtarError(f"tensor {i} has dtype {t.dtype}; FTAR takes {_DTYPES}")
        if t.layout != torch.strided or not t.is_contiguous():
            raise FatalFtarError(f"tensor {i} is not a contiguous strided tensor")
    if device.type not in ("cpu", "cuda"):
        raise FatalFtarError(f"unsupported device {device}")
    if sum(t.numel() for t in tensors) > _MAX_NUMEL:
        raise FatalFtarError("exchange too large")
    return device
