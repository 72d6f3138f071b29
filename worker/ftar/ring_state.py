"""The state of one FtarRing, shared by the modules that make it up, and the helpers they share.

A ring is one object whose threads share one lock: :mod:`worker.ftar.ring` (construction and the
public API), :mod:`worker.ftar.acceptor` (accepting the left neighbour: the handshake and its
admission rules), :mod:`worker.ftar.reconfigure` (joining a ring of a new epoch: connecting to the
right neighbour, keeping unchanged connections) and :mod:`worker.ftar.ring_steps` (the comm
thread: each exchange's chunk loop). They are mixins of ``FtarRing`` over the attributes declared
here, so the locking rules stay those of one object (see :mod:`worker.ftar.ring`).
"""

from __future__ import annotations

import queue
import socket
import threading
from dataclasses import dataclass, field

import torch

from fthsdp.worker.ftar import conn, wire
from fthsdp.worker.ftar.config import FtarConfig
from fthsdp.worker.ftar.engine import Event, Inbound, RecvJob, SendItem
from fthsdp.worker.ftar.errors import FatalFtarError, RecoverableFtarError
from fthsdp.worker.ftar.staging import CudaPools, HostBuffer, Stage
from fthsdp.worker.ftar.work import FtarWork

__all__ = ["Counters", "PeerConn", "RingState", "Topology", "WorkItem"]


@dataclass(slots=True)
class Topology:
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
class PeerConn:
    sock: socket.socket
    peer: str
    seq: int = 0
    """Exchanges started on this connection; both ends count alike, so it is per connection
    (a rebuilt connection restarts at 0 on both ends, a kept one continues on both)."""


@dataclass(slots=True)
class WorkItem:
    work: FtarWork
    stage: Stage
    contribute: bool
    num_contributors: int
    digest: bytes
    gen: int


@dataclass(slots=True)
class Counters:
    connects: int = 0
    accepts: int = 0
    ok: int = 0
    failed: int = 0
    sent: list[int] = field(default_factory=lambda: [0])
    received: Inbound = field(default_factory=Inbound)


class RingState:
    """The attributes of an FtarRing (set in ``FtarRing.__init__``) and the helpers every part
    of it uses."""

    config: FtarConfig
    address: str
    """This rank's listener address, ``host:port``."""
    _lock: threading.Lock
    _cv: threading.Condition
    """On ``_lock``: connections installed, work finished, aborts."""
    _listener: socket.socket
    _topo: Topology | None
    _in: PeerConn | None
    """The connection accepted from the left neighbour (carries its data)."""
    _out: PeerConn | None
    """The connection to the right neighbour (carries this rank's data)."""
    _connecting: socket.socket | None
    """A socket being dialled by ``reconfigure``, so that ``abort`` can shut it down."""
    _parked: list[tuple[socket.socket, wire.Hello, bytes]]
    """HELLOs of a newer epoch, with their nonces, waiting for this rank's ``reconfigure``."""
    _graveyard: list[socket.socket]
    """Sockets shut down but maybe still in use by a thread; closed when none can be."""
    _gen: int
    """Bumped by every abort and close: work and waits of an older generation give up."""
    _halted: RecoverableFtarError | None
    _dead_epoch: int
    """Epochs up to this one can no longer commit (a member was evicted): ``reconfigure`` to
    one of them fails at once, even when the abort that said so came before it started."""
    _admitting: bool
    """Whether a HELLO of the current epoch is admitted: from ``_install`` on, until the
    epoch fails (see :mod:`worker.ftar.ring`)."""
    _fatal: FatalFtarError | None
    _closed: bool
    _pending: int
    _xid: int
    _counters: Counters
    _host: HostBuffer
    _cuda: CudaPools
    _slots: list[torch.Tensor]
    _slot_views: list[memoryview]
    _scratch: torch.Tensor
    """Comm thread: where a narrow chunk is widened to float32 before its add."""
    _work_q: queue.SimpleQueue[WorkItem | None]
    _events: queue.SimpleQueue[Event]
    _send_q: queue.SimpleQueue[SendItem]
    _recv_q: queue.SimpleQueue[RecvJob | None]
    _threads: list[threading.Thread]
    """Acceptor, comm, sender and receiver, in that order."""

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

    def _ctx(self) -> dict[str, object]:
        topo = self._topo
        return {
            "ftar_address": self.address,
            "epoch": topo.epoch if topo else None,
            "ring_index": topo.index if topo else None,
            "ring_size": topo.size if topo else None,
        }
