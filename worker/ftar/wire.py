"""FTAR wire format: fixed-size big-endian structs, validated field by field before use.

Every connection starts with CHALLENGE (acceptor -> connector), then HELLO (connector ->
acceptor) answered by ACK, each carrying a proof of the job's ring key (`worker.ftar.auth`).
Each exchange then
sends, on the data direction (rank -> right neighbour), one EXCHANGE header followed by tagged
CHUNK messages; the receiver answers READY once (reverse direction) so that the sender only
pushes bulk data to a neighbour that has started the same exchange. No pickle, no variable-size
field except the bounded address in HELLO.
"""

from __future__ import annotations

import hashlib
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from fthsdp.worker.ftar.auth import NONCE_BYTES
from fthsdp.worker.ftar.errors import FatalFtarError, FtarPeerError

__all__ = [
    "ACK_SIZE",
    "CHALLENGE_SIZE",
    "CHUNK_SIZE",
    "EXCHANGE_SIZE",
    "HELLO_PREFIX_SIZE",
    "READY_SIZE",
    "Ack",
    "AckStatus",
    "Challenge",
    "ChunkHeader",
    "ExchangeHeader",
    "Hello",
    "Ready",
    "layout_digest",
    "recv_exact",
    "sendmsg_all",
]

MAGIC = b"FTAR"
VERSION = 3  # 3: the exchange header carries the ring dtype (wire compression)
MAX_ADDRESS_BYTES = 255
_IOV_MAX = 512


class _Kind(IntEnum):
    HELLO = 1
    ACK = 2
    EXCHANGE = 3
    READY = 4
    CHALLENGE = 5


class AckStatus(IntEnum):
    """The acceptor's verdict on a HELLO."""

    OK = 0
    STALE_EPOCH = 1  # the acceptor is at a newer epoch: the connector is stale
    WRONG_PEER = 2  # same epoch, but not the acceptor's expected left neighbour
    EPOCH_FAILED = 3  # same epoch, but the acceptor's exchange in it failed: it will not retry it


_PREFIX = struct.Struct(">4sHB")  # magic, version, kind
_HELLO = struct.Struct(">4sHBQIIB")  # + epoch, position, size, address length
_ACK = struct.Struct(">4sHBBQ")  # + status, acceptor epoch
_EXCHANGE = struct.Struct(">4sHBBQQIIQQI32s")
_READY = struct.Struct(">4sHBQQ")  # + epoch, seq
_CHALLENGE = struct.Struct(f">4sHB{NONCE_BYTES}s")  # + the acceptor's random challenge
_CHUNK = struct.Struct(">4sQIHI")  # chunk magic, seq, column, step, nbytes
_CHUNK_MAGIC = b"FTCK"

HELLO_PREFIX_SIZE = _HELLO.size
ACK_SIZE = _ACK.size
EXCHANGE_SIZE = _EXCHANGE.size
READY_SIZE = _READY.size
CHALLENGE_SIZE = _CHALLENGE.size
CHUNK_SIZE = _CHUNK.size


def _check_prefix(magic: bytes, version: int, kind: int, want: _Kind) -> None:
    if magic != MAGIC:
        raise FtarPeerError(f"bad magic {magic!r}: not an FTAR peer or the stream is out of sync")
    if version != VERSION:
        raise FatalFtarError(f"peer speaks FTAR wire version {version}, this rank {VERSION}")
    if kind != want:
        raise FtarPeerError(f"expected a {want.name} message, got kind {kind}")


@dataclass(frozen=True, slots=True)
class Challenge:
    """Acceptor -> connector, first on every connection: a fresh random challenge."""

    nonce: bytes

    def encode(self) -> bytes:
        return _CHALLENGE.pack(MAGIC, VERSION, _Kind.CHALLENGE, self.nonce)

    @staticmethod
    def decode(data: bytes) -> Challenge:
        magic, version, kind, nonce = _CHALLENGE.unpack(data)
        _check_prefix(magic, version, kind, _Kind.CHALLENGE)
        return Challenge(nonce)


@dataclass(frozen=True, slots=True)
class Hello:
    """Connector -> acceptor: who I am and which ring I think we are in."""

    epoch: int
    position: int
    size: int
    address: str

    def encode(self) -> bytes:
        raw = self.address.encode()
        if len(raw) > MAX_ADDRESS_BYTES:
            raise FatalFtarError(f"address longer than {MAX_ADDRESS_BYTES} bytes")
        head = _HELLO.pack(
            MAGIC, VERSION, _Kind.HELLO, self.epoch, self.position, self.size, len(raw)
        )
        return head + raw

    @staticmethod
    def decode_prefix(data: bytes, max_ring_size: int) -> tuple[int, int, int, int]:
        """Validate the fixed part; returns (epoch, position, size, address length)."""
        magic, version, kind, epoch, position, size, alen = _HELLO.unpack(data)
        _check_prefix(magic, version, kind, _Kind.HELLO)
        if not 1 <= size <= max_ring_size or position >= size:
            raise FtarPeerError(f"HELLO with position {position} of ring size {size}")
        return epoch, position, size, alen


@dataclass(frozen=True, slots=True)
class Ack:
    """Acceptor -> connector: the verdict and the acceptor's epoch."""

    status: AckStatus
    epoch: int

    def encode(self) -> bytes:
        return _ACK.pack(MAGIC, VERSION, _Kind.ACK, self.status, self.epoch)

    @staticmethod
    def decode(data: bytes) -> Ack:
        magic, version, kind, status, epoch = _ACK.unpack(data)
        _check_prefix(magic, version, kind, _Kind.ACK)
        try:
            return Ack(AckStatus(status), epoch)
        except ValueError:
            raise FtarPeerError(f"ACK with unknown status {status}") from None


@dataclass(frozen=True, slots=True)
class ExchangeHeader:
    """First message of every exchange on the data direction."""

    epoch: int
    seq: int
    position: int
    size: int
    numel: int
    chunk_elems: int
    num_contributors: int
    digest: bytes
    contribute: bool
    wire_dtype: int = 0
    """The ring dtype's code (`worker.ftar.codec.wire_code`): 0 float32, 1 bf16, 2 fp16."""

    def encode(self) -> bytes:
        if not 0 <= self.wire_dtype <= 3:
            raise FatalFtarError(f"wire dtype code {self.wire_dtype} does not fit the header")
        return _EXCHANGE.pack(
            MAGIC,
            VERSION,
            _Kind.EXCHANGE,
            int(self.contribute) | self.wire_dtype << 1,
            self.epoch,
            self.seq,
            self.position,
            self.size,
            self.numel,
            self.chunk_elems,
            self.num_contributors,
            self.digest,
        )

    @staticmethod
    def decode(data: bytes) -> ExchangeHeader:
        (
            magic,
            version,
            kind,
            flags,
            epoch,
            seq,
            position,
            size,
            numel,
            chunk_elems,
            contributors,
            digest,
        ) = _EXCHANGE.unpack(data)
        _check_prefix(magic, version, kind, _Kind.EXCHANGE)
        return ExchangeHeader(
            epoch,
            seq,
            position,
            size,
            numel,
            chunk_elems,
            contributors,
            digest,
            bool(flags & 1),
            (flags >> 1) & 3,
        )


@dataclass(frozen=True, slots=True)
class Ready:
    """Receiver -> its left neighbour: "I have started exchange (epoch, seq)"."""

    epoch: int
    seq: int

    def encode(self) -> bytes:
        return _READY.pack(MAGIC, VERSION, _Kind.READY, self.epoch, self.seq)

    @staticmethod
    def decode(data: bytes) -> Ready:
        magic, version, kind, epoch, seq = _READY.unpack(data)
        _check_prefix(magic, version, kind, _Kind.READY)
        return Ready(epoch, seq)


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """Tag in front of every chunk payload: which exchange, column and ring step it carries."""

    seq: int
    column: int
    step: int
    nbytes: int

    def encode(self) -> bytes:
        return _CHUNK.pack(_CHUNK_MAGIC, self.seq, self.column, self.step, self.nbytes)

    @staticmethod
    def decode(data: bytes) -> ChunkHeader:
        magic, seq, column, step, nbytes = _CHUNK.unpack(data)
        if magic != _CHUNK_MAGIC:
            raise FtarPeerError(f"bad chunk magic {magic!r}: stream out of sync")
        return ChunkHeader(seq, column, step, nbytes)


def layout_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """32-byte digest of the dtypes and shapes, in order (the exchange's layout)."""
    h = hashlib.blake2b(digest_size=32)
    for t in tensors:
        h.update(f"{t.dtype}:{tuple(t.shape)};".encode())
    return h.digest()


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOF before it is full is a peer error.

    MSG_WAITALL lets a blocking socket fill the whole chunk in one system call (one GIL round
    trip instead of one per TCP segment batch); the kernel receive timeout still bounds it.
    """
    while view:
        n = sock.recv_into(view, 0, socket.MSG_WAITALL)
        if n == 0:
            raise FtarPeerError("peer closed the connection")
        view = view[n:]


def sendmsg_all(sock: socket.socket, bufs: list[memoryview]) -> int:
    """Send every buffer in order with scatter-gather sendmsg (no joining copy); bytes sent."""
    pending = [b for b in bufs if b.nbytes]
    total = 0
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        total += sent
        drop = 0
        while drop < len(pending) and sent >= pending[drop].nbytes:
            sent -= pending[drop].nbytes
            drop += 1
        del pending[:drop]
        if sent:
            pending[0] = pending[0][sent:]
    return total
