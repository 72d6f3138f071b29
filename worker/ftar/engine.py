"""The chunked ring allreduce: plan, flat buffer views, and the three threads that run it.

The flat vector of an exchange (float32, or a half dtype under wire compression: see
:mod:`worker.ftar.codec`) is cut into *columns* of ``size x chunk`` elements; each
column is an independent ring allreduce over ``size`` pieces (the last column is split evenly, so
pieces may be empty): ``size - 1`` reduce-scatter steps then ``size - 1`` all-gather steps. At RS
step ``s`` rank ``r`` sends piece ``r - s`` and adds the received piece ``r - s - 1`` into its own
memory; at the last RS step it divides its finished piece by the number of contributors, so every
rank ends up with the *same bytes* (computed once, copied around the ring). AG steps receive
straight into the destination memory: the *result* buffer, which is the flat vector itself or,
for half-precision inputs of a float32 ring, the caller's own tensors. Then the bytes that need
no float32 travel narrow (:func:`carrier`): RS step 0 sends raw inputs (exact in their own
dtype) and all-gather the already rounded results, with the same numbers as an all-float32 ring
(the float32 sum is rounded once either way); only partial sums travel as float32.

Up to ``chunks_in_flight`` columns are started ahead; a column's next step is sent as soon as its
previous step arrived, so columns overlap freely and every chunk carries a tag (exchange seq,
column, step) checked before its payload is read.

Threads (all persistent, one set per ring): the comm thread drives :class:`Pipeline` (adds,
divides, schedules sends); the sender thread owns the socket to the right neighbour (scatter-
gather ``sendmsg`` straight from tensor memory); the receiver thread owns the socket from the left
neighbour (``recv_into`` reduce slots or destination memory). Socket I/O and torch ops release the
GIL, so the three overlap.
"""

from __future__ import annotations

import bisect
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch

from fthsdp.worker.ftar import conn, wire
from fthsdp.worker.ftar.errors import (
    FtarEpochMismatchError,
    FtarError,
    FtarPeerError,
    FtarTimeoutError,
)

__all__ = [
    "FlatBuffer",
    "Inbound",
    "Pipeline",
    "RecvJob",
    "RingPlan",
    "SendJob",
    "carrier",
    "receiver_loop",
    "sender_loop",
]

EventKind = Literal["chunk", "send_done", "send_failed", "recv_done", "wake"]


class Event(NamedTuple):
    """What a helper thread tells the comm thread (a tuple underneath: one per chunk)."""

    kind: EventKind
    xid: int
    """The exchange it belongs to (-1: none, a wake-up)."""
    column: int = 0
    step: int = 0
    payload: object = None
    """`chunk`: the reduce slot the chunk landed in (-1: received in place); the others: the
    latched FtarError, or None."""


class EndOfExchange(NamedTuple):
    """Sender queue item: exchange `xid` has queued its last chunk."""

    xid: int


@dataclass(frozen=True, slots=True)
class RingPlan:
    """Which piece of which column moves at which step, for one rank."""

    numel: int
    size: int
    rank: int
    chunk: int

    @property
    def columns(self) -> int:
        span = self.size * self.chunk
        return (self.numel + span - 1) // span

    @property
    def steps(self) -> int:
        return 2 * self.size - 2

    def is_reduce(self, step: int) -> bool:
        return step < self.size - 1

    def piece(self, column: int, piece: int) -> tuple[int, int]:
        start = column * self.size * self.chunk
        length = min(self.numel - start, self.size * self.chunk)
        return start + piece * length // self.size, start + (piece + 1) * length // self.size

    def send_piece(self, step: int) -> int:
        if self.is_reduce(step):
            return (self.rank - step) % self.size
        return (self.rank + 1 - (step - self.size + 1)) % self.size

    def recv_piece(self, step: int) -> int:
        if self.is_reduce(step):
            return (self.rank - step - 1) % self.size
        return (self.rank - (step - self.size + 1)) % self.size


class FlatBuffer:
    """A logical flat vector made of contiguous 1-D CPU segments of one dtype, never copied."""

    def __init__(self, segments: list[torch.Tensor]) -> None:
        self.segments = segments
        self.dtype = segments[0].dtype if segments else torch.float32
        if any(s.dtype != self.dtype for s in segments):
            raise ValueError("FlatBuffer segments must share one dtype")
        self.itemsize = self.dtype.itemsize
        # Byte views through uint8 (numpy has no bfloat16); they alias the tensors' memory. The
        # unit stride is restated: a 1-element view may carry any stride, which view() refuses.
        self.bytes = [
            s.detach().as_strided((s.numel(),), (1,)).view(torch.uint8).numpy().data
            for s in segments
        ]
        self.starts = [0]
        for s in segments:
            self.starts.append(self.starts[-1] + s.numel())
        self.numel = self.starts[-1]

    def _parts(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        out = []
        k = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            end = min(hi, self.starts[k + 1])
            if end > lo:
                out.append((k, lo - self.starts[k], end - self.starts[k]))
            lo = end
            k += 1
        return out

    def views(self, lo: int, hi: int) -> list[memoryview]:
        """Byte views of elements [lo, hi) (aliases of the segments, for send/recv_into)."""
        n = self.itemsize
        return [self.bytes[k][a * n : b * n] for k, a, b in self._parts(lo, hi)]

    def tensors(self, lo: int, hi: int) -> list[torch.Tensor]:
        """Tensor views of elements [lo, hi)."""
        return [self.segments[k][a:b] for k, a, b in self._parts(lo, hi)]

    def copy_from(self, src: FlatBuffer, lo: int, hi: int) -> None:
        """Elements [lo, hi) of ``src`` into this buffer (converting dtype), segment by segment."""
        at = lo
        for dst in self.tensors(lo, hi):
            off = 0
            for part in src.tensors(at, at + dst.numel()):
                dst[off : off + part.numel()].copy_(part)
                off += part.numel()
            at += dst.numel()


def carrier(plan: RingPlan, step: int, flat: FlatBuffer, result: FlatBuffer) -> FlatBuffer:
    """The buffer whose bytes travel at ``step``: float32 partial sums from ``flat`` (RS steps
    after the first); raw inputs (RS step 0) and results (AG) from ``result``, which holds the
    same values in the narrow dtype when it is not ``flat`` (sender and receiver agree)."""
    return flat if plan.is_reduce(step) and step > 0 else result


@dataclass(slots=True)
class SendJob:
    """Start of one exchange for the sender thread."""

    xid: int
    sock: socket.socket
    header: bytes
    ready: wire.Ready
    deadline: float
    chunk_timeout: float


SendItem = SendJob | EndOfExchange | list[memoryview] | None
"""What the sender thread takes: an exchange's start, its end, one chunk's buffers, or None
(stop)."""


@dataclass(slots=True)
class RecvJob:
    """One exchange for the receiver thread."""

    xid: int
    sock: socket.socket
    ready: bytes
    check_header: Callable[[wire.ExchangeHeader], None]
    plan: RingPlan
    flat: FlatBuffer
    result: FlatBuffer
    """Where all-gather steps land (``flat`` itself, or the caller's narrower tensors)."""
    slots: list[memoryview]
    free_slots: queue.SimpleQueue[int | None]
    seq: int
    deadline: float
    chunk_timeout: float
    stats: list[int] = field(default_factory=lambda: [0])


@dataclass(slots=True)
class Inbound:
    """The receiver thread's counters: data-phase bytes (chunk tags + payload) from the left
    neighbour, and the seconds it spent blocked on chunk payloads whose tag had arrived. A sender
    writes a chunk's tag and payload in one call, so a payload is late only while the link
    carries it: on a healthy link it is already buffered (~0 s); behind a slow link it is most of
    the exchange. What the health service judges a link by (a slow sender or a slow reduce here
    only delays the tags)."""

    bytes: int = 0
    busy_s: float = 0.0


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FtarTimeoutError("exchange timed out")
    return left


def _io_error(exc: BaseException, what: str) -> FtarError:
    if isinstance(exc, FtarError):
        return exc
    if isinstance(exc, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO/SNDTIMEO
        return FtarTimeoutError(f"{what} timed out")
    return FtarPeerError(f"{what} failed: {exc!r}")


def sender_loop(
    jobs: queue.SimpleQueue[SendItem], events: queue.SimpleQueue[Event], counters: list[int]
) -> None:
    """Sender thread: runs SendJob / chunk buffers / EndOfExchange items until ``None``."""
    job: SendJob | None = None
    failed: FtarError | None = None
    while (item := jobs.get()) is not None:
        if isinstance(item, SendJob):
            job, failed = item, None
            try:
                _start_sending(item)
            except BaseException as exc:  # latched, reported to the comm thread
                failed = _io_error(exc, "sending the exchange header")
                events.put(Event("send_failed", item.xid, payload=failed))
        elif isinstance(item, EndOfExchange):
            events.put(Event("send_done", item.xid, payload=failed))
            job = None
        elif job is not None and failed is None:
            assert isinstance(item, list)
            try:
                counters[0] += wire.sendmsg_all(job.sock, item)
            except BaseException as exc:
                failed = _io_error(exc, "sending a chunk")
                events.put(Event("send_failed", job.xid, payload=failed))


def _start_sending(job: SendJob) -> None:
    conn.set_kernel_timeout(job.sock, job.chunk_timeout)
    job.sock.sendall(job.header)
    conn.set_kernel_timeout(job.sock, _remaining(job.deadline))
    buf = bytearray(wire.READY_SIZE)
    wire.recv_exact(job.sock, memoryview(buf))
    ready = wire.Ready.decode(bytes(buf))
    if ready != job.ready:
        raise FtarEpochMismatchError(
            f"right neighbour started (epoch {ready.epoch}, seq {ready.seq}), "
            f"this rank (epoch {job.ready.epoch}, seq {job.ready.seq})"
        )
    conn.set_kernel_timeout(job.sock, job.chunk_timeout)


def receiver_loop(
    jobs: queue.SimpleQueue[RecvJob | None], events: queue.SimpleQueue[Event], counters: Inbound
) -> None:
    """Receiver thread: runs one RecvJob at a time until ``None``."""
    while (job := jobs.get()) is not None:
        error: FtarError | None = None
        try:
            _receive(job, events, counters)
        except BaseException as exc:  # latched, reported to the comm thread
            error = _io_error(exc, "receiving")
        events.put(Event("recv_done", job.xid, payload=error))


def _receive(job: RecvJob, events: queue.SimpleQueue[Event], counters: Inbound) -> None:
    sock, plan = job.sock, job.plan
    conn.set_kernel_timeout(sock, job.chunk_timeout)
    sock.sendall(job.ready)
    head = bytearray(max(wire.EXCHANGE_SIZE, wire.CHUNK_SIZE))
    view = memoryview(head)
    conn.set_kernel_timeout(sock, _remaining(job.deadline))
    wire.recv_exact(sock, view[: wire.EXCHANGE_SIZE])
    job.check_header(wire.ExchangeHeader.decode(bytes(view[: wire.EXCHANGE_SIZE])))
    seen = bytearray(plan.columns * plan.steps)
    for _ in range(len(seen)):
        conn.set_kernel_timeout(sock, _remaining(job.deadline))
        wire.recv_exact(sock, view[: wire.CHUNK_SIZE])
        tag = wire.ChunkHeader.decode(bytes(view[: wire.CHUNK_SIZE]))
        lo, hi = _check_tag(job, tag, seen)
        conn.set_kernel_timeout(sock, job.chunk_timeout)
        slot = -1
        if plan.is_reduce(tag.step):
            got = job.free_slots.get(timeout=_remaining(job.deadline))
            if got is None:
                raise FtarPeerError("exchange cancelled")
            slot = got
            began = time.monotonic()
            wire.recv_exact(sock, job.slots[slot][: tag.nbytes])
        else:
            began = time.monotonic()
            for dest in job.result.views(lo, hi):
                wire.recv_exact(sock, dest)
        counters.busy_s += time.monotonic() - began
        counters.bytes += tag.nbytes + wire.CHUNK_SIZE
        events.put(Event("chunk", job.xid, tag.column, tag.step, slot))


def _check_tag(job: RecvJob, tag: wire.ChunkHeader, seen: bytearray) -> tuple[int, int]:
    plan = job.plan
    if tag.seq != job.seq or tag.column >= plan.columns or tag.step >= plan.steps:
        raise FtarPeerError(f"unexpected chunk {tag} in exchange seq {job.seq}")
    index = tag.column * plan.steps + tag.step
    if seen[index]:
        raise FtarPeerError(f"duplicate chunk {tag}")
    seen[index] = 1
    lo, hi = plan.piece(tag.column, plan.recv_piece(tag.step))
    want = (hi - lo) * carrier(plan, tag.step, job.flat, job.result).itemsize
    if tag.nbytes != want:
        raise FtarPeerError(f"chunk {tag} carries {tag.nbytes} bytes, expected {want}")
    return lo, hi


class Pipeline:
    """Comm-thread side of one exchange: starts columns, reduces arrivals, schedules sends."""

    def __init__(
        self,
        *,
        xid: int,
        plan: RingPlan,
        flat: FlatBuffer,
        result: FlatBuffer,
        seq: int,
        slots: list[torch.Tensor],
        scratch: torch.Tensor,
        free_slots: queue.SimpleQueue[int | None],
        send_q: queue.SimpleQueue[SendItem],
        num_contributors: int,
        window: int,
    ) -> None:
        self.xid, self.plan, self.flat, self.result, self.seq = xid, plan, flat, result, seq
        self.slots, self.free_slots, self.send_q = slots, free_slots, send_q
        self.scratch = scratch  # uint8, chunk_bytes: where a narrow chunk is widened to add it
        self.num_contributors = num_contributors
        self.window = window
        self.next_column = 0
        self.pending = plan.columns * plan.steps
        self.ended = False

    def start(self) -> None:
        """Launch the first ``window`` columns."""
        for _ in range(min(self.window, self.plan.columns)):
            self._send(self.next_column, 0)
            self.next_column += 1

    def on_chunk(self, column: int, step: int, slot: int) -> None:
        """A chunk landed (in ``slot`` for RS steps, in place for AG steps)."""
        plan = self.plan
        if plan.is_reduce(step):
            lo, hi = plan.piece(column, plan.recv_piece(step))
            wire_buf = carrier(plan, step, self.flat, self.result)
            src = self.slots[slot][: (hi - lo) * wire_buf.itemsize].view(wire_buf.dtype)
            if src.dtype != self.flat.dtype:
                # Widen first (exact): torch's mixed-dtype add_ is ~10x slower than copy + add.
                wide = self.scratch[: (hi - lo) * self.flat.itemsize].view(self.flat.dtype)
                src = wide.copy_(src)
            at = 0
            for dst in self.flat.tensors(lo, hi):
                dst.add_(src[at : at + dst.numel()])
                at += dst.numel()
            self.free_slots.put(slot)
            if step == plan.size - 2:
                for dst in self.flat.tensors(lo, hi):
                    dst.div_(self.num_contributors)
                if self.result is not self.flat:  # round once, then gather the narrow bytes
                    self.result.copy_from(self.flat, lo, hi)
        self.pending -= 1
        if step + 1 < plan.steps:
            self._send(column, step + 1)
        elif self.next_column < plan.columns:
            self._send(self.next_column, 0)
            self.next_column += 1

    def _send(self, column: int, step: int) -> None:
        lo, hi = self.plan.piece(column, self.plan.send_piece(step))
        buf = carrier(self.plan, step, self.flat, self.result)
        tag = wire.ChunkHeader(self.seq, column, step, (hi - lo) * buf.itemsize).encode()
        self.send_q.put([memoryview(tag), *buf.views(lo, hi)])
