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
epoch is then checked by every exchange header). Any failed exchange closes both connections at
once, which also tells the neighbours fast, and latches the ring as broken until the next
``reconfigure``. ``abort`` shuts the sockets down, which wakes every blocked thread immediately.

Threads: the caller's (allreduce/reconfigure/abort), the acceptor, and the comm, sender and
receiver threads of :mod:`worker.ftar.engine`. ``allreduce`` and ``reconfigure`` must not run
concurrently with each other (the Manager serializes them); ``abort``, ``close`` and ``stats`` are
safe from any thread.
"""

from __future__ import annotations

import logging
import queue
import random
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fthsdp.worker.ftar import auth, conn, wire
from fthsdp.worker.ftar.config import FtarConfig
from fthsdp.worker.ftar.engine import (
    EndOfExchange,
    Event,
    FlatBuffer,
    Pipeline,
    RecvJob,
    RingPlan,
    SendItem,
    SendJob,
    receiver_loop,
    sender_loop,
)
from fthsdp.worker.ftar.errors import (
    FatalFtarError,
    FtarAbortedError,
    FtarEpochMismatchError,
    FtarError,
    FtarLayoutMismatchError,
    FtarPeerError,
    FtarTimeoutError,
    RecoverableFtarError,
)
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
_JITTER = random.Random()
"""Backoff jitter from a generator of our own: the module-level ones are the user's, and
`RNGState` carries them from a healthy replica to a recovering one, so every draw here would
make the replicas' states differ (and their snapshots disagree)."""
_MAX_PARKED = 8
_MAX_HANDSHAKES = 32
"""Handshakes in progress at once; a connection beyond them is closed at once (a legitimate
ring has two neighbours per rank reconnecting, not dozens)."""
_MAX_NUMEL = 1 << 40
_HELPER_GRACE_S = 5.0


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


@dataclass(slots=True)
class _Topology:
    peers: tuple[str, ...]
    index: int
    epoch: int

    @property
    def size(self) -> int:
        return len(self.peers)

    @property
    def left(self) -> str:
        return self.peers[(self.index - 1) % self.size]

    @property
    def right(self) -> str:
        return self.peers[(self.index + 1) % self.size]


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    peer: str
    seq: int = 0
    """Exchanges started on this connection; both ends count alike, so it is per connection
    (a rebuilt connection restarts at 0 on both ends, a kept one continues on both)."""


@dataclass(slots=True)
class _Item:
    work: FtarWork
    stage: Stage
    contribute: bool
    num_contributors: int
    digest: bytes
    gen: int


@dataclass(slots=True)
class _Counters:
    connects: int = 0
    accepts: int = 0
    ok: int = 0
    failed: int = 0
    sent: list[int] = field(default_factory=lambda: [0])
    received: list[int] = field(default_factory=lambda: [0])


class FtarRing:
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
        self._topo: _Topology | None = None
        self._in: _Conn | None = None
        self._out: _Conn | None = None
        self._connecting: socket.socket | None = None
        self._parked: list[tuple[socket.socket, wire.Hello, bytes]] = []
        self._graveyard: list[socket.socket] = []
        self._gen = 0
        self._halted: RecoverableFtarError | None = FtarAbortedError("ring not configured yet")
        self._admitting = False
        """Whether a HELLO of the current epoch is admitted: from ``_install`` on, until the
        epoch fails (see the module docs)."""
        self._fatal: FatalFtarError | None = None
        self._closed = False
        self._pending = 0
        self._xid = 0
        self._counters = _Counters()
        self._host = HostBuffer()
        self._cuda = CudaPools()
        self._slots: list[torch.Tensor] = []
        self._slot_views: list[memoryview] = []
        self._work_q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._send_q: queue.SimpleQueue[SendItem] = queue.SimpleQueue()
        self._recv_q: queue.SimpleQueue[RecvJob | None] = queue.SimpleQueue()
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
            bytes_received=c.received[0],
        )

    def reconfigure(self, peers: Sequence[str], my_index: int, epoch: int) -> None:
        """Join the ring ``peers`` (listener addresses in ring order) at ``my_index``.

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
        item = _Item(work, stage, contribute, num_contributors, wire.layout_digest(tensors), 0)
        with self._lock:
            if self._halted is not None:
                stage.release()
                work._finish(self._halted)
                return work
            item.gen = self._gen
            self._pending += 1
            self._work_q.put(item)
        return work

    def abort(self, reason: str = "aborted") -> None:
        """Fail in-flight and queued work (FtarAbortedError) and unblock every wait now.

        Thread-safe and idempotent. The ring stays unusable until the next ``reconfigure``.
        """
        with self._lock:
            if self._closed:
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

    # ------------------------------------------------------------------ validation

    def _validate_ring(self, peers: Sequence[str], my_index: int, epoch: int) -> _Topology:
        if isinstance(peers, str) or not all(isinstance(p, str) for p in peers):
            raise FatalFtarError("peers must be a sequence of 'host:port' strings")
        ring = tuple(peers)
        if not 1 <= len(ring) <= self.config.max_ring_size:
            raise FatalFtarError(f"ring size must be in [1, {self.config.max_ring_size}]")
        for p in ring:
            conn.parse_address(p)
            if len(p.encode()) > wire.MAX_ADDRESS_BYTES:
                raise FatalFtarError(f"address too long: {p!r}")
        if len(set(ring)) != len(ring):
            raise FatalFtarError(f"duplicate addresses in ring {ring}")
        if not isinstance(my_index, int) or not 0 <= my_index < len(ring):
            raise FatalFtarError(f"my_index {my_index!r} out of range for {len(ring)} peers")
        if not isinstance(epoch, int) or not 0 <= epoch < 1 << 63:
            raise FatalFtarError(f"epoch must be an int in [0, 2**63), got {epoch!r}")
        cur = self._topo
        if cur is not None and epoch < cur.epoch:
            raise FatalFtarError(f"epoch {epoch} is older than the current {cur.epoch}")
        if cur is not None and epoch == cur.epoch and (cur.peers, cur.index) != (ring, my_index):
            raise FatalFtarError(f"ring changed without a new epoch (epoch {epoch})")
        return _Topology(ring, my_index, epoch)

    def _check_usable(self) -> None:
        if self._closed:
            raise FatalFtarError("ring is closed")
        if self._fatal is not None:
            raise self._fatal

    def _make_stage(
        self, tensors: list[torch.Tensor], device: torch.device, contribute: bool
    ) -> Stage:
        if device.type == "cuda":
            return CudaStage(tensors, self._cuda, contribute=contribute)
        if all(t.dtype == torch.float32 for t in tensors):
            return DirectStage(tensors)
        return HostStage(tensors, self._host)

    # ------------------------------------------------------------------ connections

    def _bury_conns(self) -> None:
        """Shut both connections down now; close them once no thread can be using them."""
        for c in (self._in, self._out):
            if c is not None:
                conn.shutdown_quietly(c.sock)
                self._graveyard.append(c.sock)
        self._in = self._out = None

    def _flush_graveyard(self) -> None:
        for sock in self._graveyard:
            conn.close_quietly(sock)
        self._graveyard.clear()

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

    def _install(self, topo: _Topology) -> tuple[bool, bool]:
        """Swap in ``topo`` keeping healthy connections to unchanged neighbours (lock held)."""
        n = topo.size
        keep_in = (
            n > 1
            and self._in is not None
            and self._in.peer == topo.left
            and conn.is_alive(self._in.sock)
        )
        keep_out = (
            n > 1
            and self._out is not None
            and self._out.peer == topo.right
            and conn.is_alive(self._out.sock)
        )
        for c, keep in ((self._in, keep_in), (self._out, keep_out)):
            if c is not None and not keep:
                conn.close_quietly(c.sock)
        self._in = self._in if keep_in else None
        self._out = self._out if keep_out else None
        self._topo = topo
        self._halted = FtarAbortedError("reconfigure in progress")
        self._admitting = True
        parked, self._parked = self._parked, []
        for sock, hello, nonce in parked:
            if hello.epoch > topo.epoch:
                self._parked.append((sock, hello, nonce))
            else:
                self._admit_locked(sock, hello, nonce)
        return keep_in, keep_out

    def _connect_right(self, topo: _Topology, gen: int, deadline: float) -> None:
        hello = wire.Hello(topo.epoch, topo.index, topo.size, topo.peers[topo.index]).encode()
        backoff = 0.002
        while True:
            self._check_gen(gen)
            left = deadline - time.monotonic()
            if left <= 0:
                raise FtarTimeoutError(f"could not connect to right neighbour {topo.right}")
            try:
                ack = self._try_connect(topo.right, hello, left, gen)
            except (OSError, FtarPeerError) as exc:
                log.debug("ftar connect to %s failed: %r", topo.right, exc, extra=self._ctx())
                with self._cv:
                    self._cv.wait(min(backoff, max(deadline - time.monotonic(), 0)))
                backoff = min(backoff * 2, 0.1) * _JITTER.uniform(0.8, 1.2)
                continue
            if ack.status == wire.AckStatus.STALE_EPOCH:
                raise FtarEpochMismatchError(
                    f"right neighbour {topo.right} is at epoch {ack.epoch}, newer than {topo.epoch}"
                )
            if ack.status == wire.AckStatus.EPOCH_FAILED:
                raise FtarEpochMismatchError(
                    f"right neighbour {topo.right} gave up epoch {topo.epoch} (its exchange "
                    "failed): the retry happens on a new quorum"
                )
            if ack.status == wire.AckStatus.WRONG_PEER:
                raise FatalFtarError(
                    f"right neighbour {topo.right} at epoch {ack.epoch} does not expect "
                    f"{topo.peers[topo.index]} as its left: ring disagreement within an epoch"
                )
            return

    def _try_connect(self, address: str, hello: bytes, timeout: float, gen: int) -> wire.Ack:
        sock = conn.dial(address, timeout, self.config.socket_buffer_bytes)
        with self._lock:
            self._connecting = sock
            aborted = self._gen != gen
        try:
            if aborted:
                raise FtarAbortedError("aborted while connecting")
            self._counters.connects += 1
            ack = self._handshake(sock, hello)
        except BaseException:
            conn.close_quietly(sock)
            raise
        finally:
            with self._lock:
                self._connecting = None
        with self._lock:
            if ack.status != wire.AckStatus.OK or self._gen != gen:
                conn.close_quietly(sock)
            else:
                sock.settimeout(None)  # blocking; the engine bounds it with kernel timeouts
                self._out = _Conn(sock, address)
        return ack

    def _handshake(self, sock: socket.socket, hello: bytes) -> wire.Ack:
        """Connector side: answer the acceptor's challenge with HELLO and our proof, then read
        the ACK and check the acceptor's proof (see `worker.ftar.auth`)."""
        key = self.config.auth_key
        buf = bytearray(wire.CHALLENGE_SIZE)
        wire.recv_exact(sock, memoryview(buf))
        challenge = wire.Challenge.decode(bytes(buf)).nonce
        nonce = auth.new_nonce()
        sock.sendall(hello + nonce + auth.hello_proof(key, challenge, hello, nonce))
        buf = bytearray(wire.ACK_SIZE + auth.MAC_BYTES)
        wire.recv_exact(sock, memoryview(buf))
        raw = bytes(buf[: wire.ACK_SIZE])
        auth.check_proof(auth.ack_proof(key, nonce, raw), bytes(buf[wire.ACK_SIZE :]), "ACK")
        return wire.Ack.decode(raw)

    def _await_left(self, topo: _Topology, gen: int, deadline: float) -> None:
        with self._cv:
            while self._in is None:
                self._check_gen(gen)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FtarTimeoutError(f"left neighbour {topo.left} did not connect in time")
                self._cv.wait(left)

    def _check_gen(self, gen: int) -> None:
        if self._closed or self._gen != gen:
            raise FtarAbortedError("aborted during reconfigure")

    def _accept_loop(self) -> None:
        """Accepts; each connection's handshake runs in a thread of its own under one overall
        deadline, so a silent or trickling client never holds up the neighbour behind it."""
        handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            self._counters.accepts += 1
            if self._closed:
                conn.close_quietly(sock)
                return
            if not handshakes.acquire(blocking=False):
                log.warning("ftar dropped a connection: too many handshakes", extra=self._ctx())
                conn.close_quietly(sock)
                continue
            threading.Thread(
                target=self._accept_handshake,
                args=(sock, handshakes),
                name=f"ftar-hello-{self.address}",
                daemon=True,
            ).start()

    def _accept_handshake(
        self, sock: socket.socket, handshakes: threading.BoundedSemaphore
    ) -> None:
        # Past the deadline the socket is shut down under the reader, whatever it is waiting on.
        cutoff = threading.Timer(
            self.config.hello_timeout.total_seconds(), conn.shutdown_quietly, (sock,)
        )
        cutoff.start()
        try:
            conn.tune(sock, 0)
            challenge = auth.new_nonce()
            sock.settimeout(self.config.hello_timeout.total_seconds())
            sock.sendall(wire.Challenge(challenge).encode())
            hello, nonce = conn.read_hello(
                sock, self.config.max_ring_size, self.config.auth_key, challenge
            )
        except (OSError, FtarError) as exc:
            log.warning("ftar rejected a connection: %r", exc, extra=self._ctx())
            conn.close_quietly(sock)
            return
        finally:
            cutoff.cancel()
            handshakes.release()
        with self._lock:
            if self._closed:
                conn.close_quietly(sock)
                return
            topo = self._topo
            if topo is None or hello.epoch > topo.epoch:
                self._park_locked(sock, hello, nonce)
            else:
                self._admit_locked(sock, hello, nonce)

    def _park_locked(self, sock: socket.socket, hello: wire.Hello, nonce: bytes) -> None:
        self._parked.append((sock, hello, nonce))
        if len(self._parked) > _MAX_PARKED:
            old, _, _ = self._parked.pop(0)
            conn.close_quietly(old)

    def _admit_locked(self, sock: socket.socket, hello: wire.Hello, nonce: bytes) -> None:
        topo = self._topo
        assert topo is not None
        if hello.epoch < topo.epoch:
            status = wire.AckStatus.STALE_EPOCH
        elif (hello.address, hello.position, hello.size) != (
            topo.left,
            (topo.index - 1) % topo.size,
            topo.size,
        ) or topo.size == 1:
            status = wire.AckStatus.WRONG_PEER
        elif not self._admitting:
            status = wire.AckStatus.EPOCH_FAILED
        else:
            status = wire.AckStatus.OK
        try:
            sock.settimeout(self.config.connect_timeout.total_seconds())
            ack = wire.Ack(status, topo.epoch).encode()
            sock.sendall(ack + auth.ack_proof(self.config.auth_key, nonce, ack))
        except OSError:
            conn.close_quietly(sock)
            return
        if status != wire.AckStatus.OK:
            log.warning(
                "ftar refused %s (epoch %d): %s",
                hello.address,
                hello.epoch,
                status.name,
                extra=self._ctx(),
            )
            conn.close_quietly(sock)
            return
        if self._in is not None:
            conn.shutdown_quietly(self._in.sock)
            self._graveyard.append(self._in.sock)
        sock.settimeout(None)  # blocking; the engine bounds it with kernel timeouts
        self._in = _Conn(sock, hello.address)
        self._cv.notify_all()

    # ------------------------------------------------------------------ comm thread

    def _comm_loop(self) -> None:
        try:
            while (item := self._work_q.get()) is not None:
                try:
                    error, done, side = self._run(item)
                except BaseException as exc:  # a bug here must not strand the caller's wait()
                    log.exception("ftar comm thread failure", extra=self._ctx())
                    error, done, side = (
                        self._fail(FatalFtarError(f"comm thread: {exc!r}"), item),
                        None,
                        None,
                    )
                item.stage.release()
                if error is None:
                    self._counters.ok += 1
                else:
                    self._counters.failed += 1
                item.work._finish(error, done, side)
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()
        finally:
            self._send_q.put(None)
            self._recv_q.put(None)
            for t in self._threads[2:]:
                t.join(timeout=10)

    def _run(
        self, item: _Item
    ) -> tuple[FtarError | None, torch.cuda.Event | None, torch.cuda.Stream | None]:
        with self._lock:
            failure = self._precheck(item)
            topo, inc, out = self._topo, self._in, self._out
            if failure is None and topo is not None and inc is not None and out is not None:
                inc.seq += 1
                out.seq += 1
        if failure is not None or topo is None:
            return failure or FtarAbortedError("no ring"), None, None
        deadline = time.monotonic() + self.config.exchange_timeout.total_seconds()
        try:
            flat = item.stage.begin(
                contribute=item.contribute,
                deadline=deadline,
                cancelled=lambda: self._gen != item.gen,
            )
            if topo.size == 1:
                for seg in flat.segments:
                    seg.div_(item.num_contributors)
            else:
                assert inc is not None
                assert out is not None
                self._exchange(item, topo, flat, inc, out, deadline)
            done, side = item.stage.end()
        except FtarError as exc:
            return self._fail(exc, item), None, None
        except Exception as exc:  # a local failure (torch, memory, a bug): crash the rank
            log.exception("ftar local failure", extra=self._ctx())
            return self._fail(FatalFtarError(f"local failure in FTAR: {exc!r}"), item), None, None
        return None, done, side

    def _precheck(self, item: _Item) -> FtarError | None:
        if self._fatal is not None:
            return self._fatal
        if item.gen != self._gen:
            return self._halted or FtarAbortedError("aborted")
        if self._halted is not None:
            return self._halted
        topo = self._topo
        if topo is not None and topo.size > 1 and (self._in is None or self._out is None):
            return FtarPeerError("ring connections are gone; reconfigure")
        return None

    def _fail(self, exc: FtarError, item: _Item) -> FtarError:
        with self._lock:
            if item.gen != self._gen and not isinstance(exc, FatalFtarError):
                exc = FtarAbortedError(f"{self._halted or 'aborted'} (while exchanging: {exc})")
            if isinstance(exc, FatalFtarError):
                self._fatal = self._fatal or exc
            self._admitting = False
            if self._halted is None:
                self._halted = (
                    exc if isinstance(exc, RecoverableFtarError) else FtarAbortedError(str(exc))
                )
            self._bury_conns()
            self._flush_graveyard()
        log.warning("ftar exchange failed: %s", exc, extra=self._ctx())
        return exc

    def _ensure_slots(self) -> None:
        if not self._slots:
            c = self.config
            self._slots = [
                torch.empty(c.chunk_elems, dtype=torch.float32) for _ in range(c.chunks_in_flight)
            ]
            self._slot_views = [s.numpy().data.cast("B") for s in self._slots]

    def _exchange(
        self,
        item: _Item,
        topo: _Topology,
        flat: FlatBuffer,
        inc: _Conn,
        out: _Conn,
        deadline: float,
    ) -> None:
        self._ensure_slots()
        c = self.config
        self._xid += 1
        xid = self._xid
        mine = wire.ExchangeHeader(
            topo.epoch,
            out.seq,
            topo.index,
            topo.size,
            flat.numel,
            c.chunk_elems,
            item.num_contributors,
            item.digest,
            item.contribute,
        )
        plan = RingPlan(flat.numel, topo.size, topo.index, c.chunk_elems)
        free: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        for i in range(c.chunks_in_flight):
            free.put(i)
        chunk_s = c.chunk_timeout.total_seconds()
        self._send_q.put(
            SendJob(
                xid, out.sock, mine.encode(), wire.Ready(topo.epoch, out.seq), deadline, chunk_s
            )
        )
        self._recv_q.put(
            RecvJob(
                xid,
                inc.sock,
                wire.Ready(topo.epoch, inc.seq).encode(),
                lambda h: _check_header(mine, inc.seq, topo.left, h),
                plan,
                flat,
                self._slot_views,
                free,
                inc.seq,
                deadline,
                chunk_s,
            )
        )
        pipe = Pipeline(
            xid=xid,
            plan=plan,
            flat=flat,
            seq=out.seq,
            slots=self._slots,
            free_slots=free,
            send_q=self._send_q,
            num_contributors=item.num_contributors,
            window=c.chunks_in_flight,
        )
        done = {"send_done": False, "recv_done": False}
        try:
            pipe.start()
            while not all(done.values()):
                if pipe.pending == 0 and not pipe.ended:
                    self._send_q.put(EndOfExchange(xid))
                    pipe.ended = True
                kind, exid, column, step, payload = self._next_event(deadline, item.gen)
                if exid != xid:
                    continue
                if kind == "chunk":
                    assert isinstance(payload, int)
                    pipe.on_chunk(column, step, payload)
                    continue
                if kind in done:
                    done[kind] = True
                if isinstance(payload, FtarError):
                    raise payload
        except BaseException:
            self._cancel(xid, pipe, free, done)
            raise

    def _next_event(self, deadline: float, gen: int) -> Event:
        left = deadline - time.monotonic()
        if self._gen != gen:
            raise FtarAbortedError("aborted")
        if left <= 0:
            raise FtarTimeoutError(
                f"exchange timed out after {self.config.exchange_timeout.total_seconds()}s"
            )
        try:
            return self._events.get(timeout=left)
        except queue.Empty:
            raise FtarTimeoutError(
                f"exchange timed out after {self.config.exchange_timeout.total_seconds()}s"
            ) from None

    def _cancel(
        self, xid: int, pipe: Pipeline, free: queue.SimpleQueue[int | None], done: dict[str, bool]
    ) -> None:
        """Stop the helper threads' part of exchange ``xid`` before its memory is released."""
        with self._lock:
            self._bury_conns()
        if not pipe.ended:
            self._send_q.put(EndOfExchange(xid))
        free.put(None)
        grace = time.monotonic() + max(_HELPER_GRACE_S, self.config.chunk_timeout.total_seconds())
        while not all(done.values()):
            left = grace - time.monotonic()
            try:
                kind, exid, *_ = self._events.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise FatalFtarError("FTAR helper threads did not stop after cancel") from None
            if exid == xid and kind in done:
                done[kind] = True

    def _ctx(self) -> dict[str, object]:
        topo = self._topo
        return {
            "ftar_address": self.address,
            "epoch": topo.epoch if topo else None,
            "ring_index": topo.index if topo else None,
            "ring_size": topo.size if topo else None,
        }


def _check_header(
    mine: wire.ExchangeHeader, in_seq: int, left: str, theirs: wire.ExchangeHeader
) -> None:
    """Validate the left neighbour's exchange header against this rank's (receiver thread)."""
    if theirs.epoch != mine.epoch:
        raise FtarEpochMismatchError(
            f"left neighbour {left} is at epoch {theirs.epoch}, this rank at {mine.epoch}"
        )
    if theirs.seq != in_seq:
        raise FtarPeerError(f"left neighbour {left} is at exchange {theirs.seq}, not {in_seq}")
    if (theirs.size, theirs.position) != (mine.size, (mine.position - 1) % mine.size):
        raise FatalFtarError(
            f"left neighbour {left} thinks it is {theirs.position}/{theirs.size}, "
            f"expected {(mine.position - 1) % mine.size}/{mine.size} in epoch {mine.epoch}"
        )
    if theirs.chunk_elems != mine.chunk_elems:
        raise FatalFtarError(
            f"left neighbour {left} uses chunk_bytes {theirs.chunk_elems * 4}, "
            f"this rank {mine.chunk_elems * 4}: configure every rank alike"
        )
    if (theirs.numel, theirs.digest, theirs.num_contributors) != (
        mine.numel,
        mine.digest,
        mine.num_contributors,
    ):
        raise FtarLayoutMismatchError(
            f"left neighbour {left} exchanges {theirs.numel} elements (layout "
            f"{theirs.digest.hex()[:12]}, {theirs.num_contributors} contributors), this rank "
            f"{mine.numel} ({mine.digest.hex()[:12]}, {mine.num_contributors}) in epoch "
            f"{mine.epoch}"
        )


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
