"""Reconfiguring an FtarRing: validating a new ring, swapping it in while keeping healthy
connections to unchanged neighbours, connecting to the right neighbour (with backoff) and
waiting for the left one to connect (see :mod:`worker.ftar.ring` for the scheme).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence

from fthsdp.worker.ftar import conn, wire
from fthsdp.worker.ftar.acceptor import Acceptor
from fthsdp.worker.ftar.errors import (
    FatalFtarError,
    FtarAbortedError,
    FtarEpochMismatchError,
    FtarPeerError,
    FtarTimeoutError,
)
from fthsdp.worker.ftar.ring_state import PeerConn, Topology

__all__ = ["Reconfigurer"]

log = logging.getLogger(__name__)

_JITTER = random.Random()
"""Backoff jitter from a generator of our own: the module-level ones are the user's, and
`RNGState` carries them from a healthy replica to a recovering one, so every draw here would
make the replicas' states differ (and their snapshots disagree)."""


_AWAIT_POLL_S = 0.01
"""How often a rank awaiting its left neighbour checks its right connection is still open."""


class Reconfigurer(Acceptor):
    """FtarRing's part of ``reconfigure`` that joins the new ring (a mixin; it admits the
    HELLOs parked for the new epoch through the :class:`Acceptor`)."""

    def _validate_ring(self, peers: Sequence[str], my_index: int, epoch: int) -> Topology:
        if isinstance(peers, str) or not all(isinstance(p, str) for p in peers):
            raise FatalFtarError("peers must be a sequence of 'host:port' strings")
        ring = tuple(peers)
        if not 1 <= len(ring) <= self.config.max_ring_size:
            raise FatalFtarError(f"ring size must be in [1, {self.config.max_ring_size}]")
        if not isinstance(my_index, int) or not 0 <= my_index < len(ring):
            raise FatalFtarError(f"my_index {my_index!r} out of range for {len(ring)} peers")
        # This rank talks to its neighbours only: the others may be "" (unknown here).
        talks_to = {my_index, (my_index - 1) % len(ring), (my_index + 1) % len(ring)}
        for i, p in enumerate(ring):
            if not p and i not in talks_to:
                continue
            conn.parse_address(p)
            if len(p.encode()) > wire.MAX_ADDRESS_BYTES:
                raise FatalFtarError(f"address too long: {p!r}")
        known = [p for p in ring if p]
        if len(set(known)) != len(known):
            raise FatalFtarError(f"duplicate addresses in ring {ring}")
        if not isinstance(epoch, int) or not 0 <= epoch < 1 << 63:
            raise FatalFtarError(f"epoch must be an int in [0, 2**63), got {epoch!r}")
        cur = self._topo
        if cur is not None and epoch < cur.epoch:
            raise FatalFtarError(f"epoch {epoch} is older than the current {cur.epoch}")
        if cur is not None and epoch == cur.epoch and (cur.peers, cur.index) != (ring, my_index):
            raise FatalFtarError(f"ring changed without a new epoch (epoch {epoch})")
        return Topology(ring, my_index, epoch)

    def _install(self, topo: Topology) -> tuple[bool, bool]:
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

    def _connect_right(self, topo: Topology, gen: int, deadline: float) -> None:
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
                self._out = PeerConn(sock, address)
        return ack

    def _await_left(self, topo: Topology, gen: int, deadline: float) -> None:
        """Waits for the left neighbour's HELLO. Fails early once the right neighbour closed
        the connection just made: the epoch failed there, and a left neighbour that kept a
        connection this rank had already buried (it decided to keep it an instant before this
        rank's abort reached it) never connects again. Its exchange fails on that connection,
        and the failure travels round the ring to here; without this check, this rank would
        wait out the connect timeout while the quorum waits for it to ask."""
        with self._cv:
            while self._in is None:
                self._check_gen(gen)
                out = self._out
                if out is not None and not conn.is_alive(out.sock):
                    raise FtarPeerError(
                        f"right neighbour {topo.right} closed the connection while this rank "
                        f"awaited {topo.left}: epoch {topo.epoch} failed there"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FtarTimeoutError(f"left neighbour {topo.left} did not connect in time")
                self._cv.wait(min(left, _AWAIT_POLL_S))

    def _check_gen(self, gen: int) -> None:
        if self._closed or self._gen != gen:
            raise FtarAbortedError("aborted during reconfigure")
