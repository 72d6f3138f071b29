"""The comm thread of an FtarRing: it runs the queued exchanges in FIFO order, each one's
header check and reduce-scatter / all-gather chunk loop (:class:`worker.ftar.engine.Pipeline`
driven by the sender's and receiver's events), and latches every failure into the exchange's
work and the ring (see :mod:`worker.ftar.engine` for the algorithm).
"""

from __future__ import annotations

import logging
import queue
import time

import torch

from fthsdp.worker.ftar import codec, wire
from fthsdp.worker.ftar.engine import (
    EndOfExchange,
    Event,
    FlatBuffer,
    Pipeline,
    RecvJob,
    RingPlan,
    SendJob,
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
from fthsdp.worker.ftar.ring_state import PeerConn, RingState, Topology, WorkItem

__all__ = ["RingSteps"]

log = logging.getLogger(__name__)

_HELPER_GRACE_S = 5.0


class RingSteps(RingState):
    """FtarRing's comm thread (a mixin over :class:`RingState`)."""

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
        self, item: WorkItem
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

    def _precheck(self, item: WorkItem) -> FtarError | None:
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

    def _fail(self, exc: FtarError, item: WorkItem) -> FtarError:
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
        """Reduce slots as raw bytes (``chunk_bytes`` each), viewed per exchange in its dtype."""
        if not self._slots:
            c = self.config
            self._slots = [
                torch.empty(c.chunk_bytes, dtype=torch.uint8) for _ in range(c.chunks_in_flight)
            ]
            self._slot_views = [s.numpy().data for s in self._slots]
            self._scratch = torch.empty(c.chunk_bytes, dtype=torch.uint8)

    def _exchange(
        self,
        item: WorkItem,
        topo: Topology,
        flat: FlatBuffer,
        inc: PeerConn,
        out: PeerConn,
        deadline: float,
    ) -> None:
        self._ensure_slots()
        c = self.config
        self._xid += 1
        xid = self._xid
        chunk = c.chunk_bytes // flat.itemsize  # chunk_bytes of payload whatever the dtype
        mine = wire.ExchangeHeader(
            topo.epoch,
            out.seq,
            topo.index,
            topo.size,
            flat.numel,
            chunk,
            item.num_contributors,
            item.digest,
            item.contribute,
            codec.wire_code(flat.dtype),
        )
        plan = RingPlan(flat.numel, topo.size, topo.index, chunk)
        result = item.stage.gather_into() or flat
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
                result,
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
            result=result,
            seq=out.seq,
            slots=self._slots,
            scratch=self._scratch,
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
    if theirs.wire_dtype != mine.wire_dtype:
        raise FatalFtarError(
            f"left neighbour {left} runs the ring in {codec.wire_dtype_of(theirs.wire_dtype)}, "
            f"this rank in {codec.wire_dtype_of(mine.wire_dtype)}: configure wire_compression "
            "alike on every rank"
        )
    if theirs.chunk_elems != mine.chunk_elems:
        raise FatalFtarError(
            f"left neighbour {left} uses chunks of {theirs.chunk_elems} elements, this rank "
            f"{mine.chunk_elems}: configure chunk_bytes alike on every rank"
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
