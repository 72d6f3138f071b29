"""Configuration of one FTAR ring (one per rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

__all__ = ["FtarConfig"]

_MAX_CHUNK_BYTES = 1 << 30
_ELEMENT_BYTES = 4  # chunks hold whole float32 (and so half-precision) elements


@dataclass(frozen=True, kw_only=True, slots=True)
class FtarConfig:
    """How a rank's FTAR ring listens, pipelines and times out."""

    bind_host: str = "127.0.0.1"
    """Host the listener binds; neighbours connect to the address published from ``.address``."""

    port: int = 0
    """Listener port; 0 picks a free one (read it back from ``FtarRing.address``)."""

    chunk_bytes: int = 8 * 1024 * 1024
    """Pipeline chunk size S in bytes of payload (a multiple of 4), whatever the ring dtype.
    8 MiB is the paper's choice and measured best on loopback here (bench/ftar.py): bigger
    chunks mean fewer system calls and thread hand-offs per byte."""

    chunks_in_flight: int = 2
    """Pipeline depth C: chunk columns started ahead, and reduce buffers held per receiver, so
    at most S x C bytes wait in user space per peer."""

    chunk_timeout: timedelta = timedelta(seconds=10)
    """Bound on moving one started chunk (and on sending once the right neighbour is ready)."""

    exchange_timeout: timedelta = timedelta(seconds=60)
    """Bound on one whole exchange, including waiting for late neighbours to start it. Under a
    `Manager` it is `ManagerConfig.exchange_timeout` (leave this unset there)."""

    connect_timeout: timedelta = timedelta(seconds=10)
    """Bound on ``reconfigure`` establishing both neighbour connections (with retries)."""

    hello_timeout: timedelta = timedelta(seconds=2)
    """Bound on an accepted connection's whole handshake (its HELLO, however it trickles in):
    a peer sends it at once; a silent or slow client is dropped by then, and since handshakes
    run side by side it never delays the expected neighbour."""

    socket_buffer_bytes: int = 0
    """SO_SNDBUF/SO_RCVBUF for ring sockets; 0 leaves the kernel's autotuning in charge."""

    wire_compression: Literal["none", "bf16", "fp16"] = "none"
    """Opt-in lossy ring dtype. ``"none"`` (the default): the ring runs in float32 (half inputs
    are staged and accumulate in float32). ``"bf16"``/``"fp16"``: it runs in that half dtype,
    half the wire bytes; inputs of that dtype are reduced in place, others rounded to it once on
    entry; each ring hop rounds the partial sum, like gloo/NCCL on half tensors. Every rank
    still ends bitwise identical; the exact sum order is in :mod:`worker.ftar.codec`. Every
    rank of a ring must agree (checked by each exchange header)."""

    max_ring_size: int = 4096
    """Largest ring accepted from a peer's handshake (bounds wire fields before use)."""

    auth_key: bytes = field(default=b"", repr=False)
    """The job's ring key (`worker.ftar.auth.ring_key` of its token): every connection must prove
    it holds the same key. The Manager sets it from the job's token. Empty, the default of a bare
    ring, still runs the handshake but with an empty key, so it authenticates nothing: only for
    tests and benchmarks on one host."""

    def __post_init__(self) -> None:
        if not self.bind_host:
            raise ValueError("bind_host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not _ELEMENT_BYTES <= self.chunk_bytes <= _MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [4, {_MAX_CHUNK_BYTES}]")
        if self.chunk_bytes % _ELEMENT_BYTES:
            raise ValueError("chunk_bytes must be a multiple of 4 (float32 elements)")
        if not 1 <= self.chunks_in_flight <= 1024:
            raise ValueError("chunks_in_flight must be in [1, 1024]")
        for name in ("chunk_timeout", "exchange_timeout", "connect_timeout", "hello_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"{name} must be a positive timedelta")
        if self.chunk_timeout > self.exchange_timeout:
            raise ValueError("chunk_timeout must not exceed exchange_timeout")
        if self.socket_buffer_bytes and not 4096 <= self.socket_buffer_bytes <= _MAX_CHUNK_BYTES:
            raise ValueError("socket_buffer_bytes must be 0 (autotune) or in [4096, 1 GiB]")
        if not isinstance(self.auth_key, bytes) or len(self.auth_key) > 1024:
            raise ValueError("auth_key must be bytes, at most 1024 of them")
        if self.wire_compression not in ("none", "bf16", "fp16"):
            raise ValueError("wire_compression must be 'none', 'bf16' or 'fp16'")
        if not 1 <= self.max_ring_size <= 1 << 20:
            raise ValueError("max_ring_size must be in [1, 1048576]")

    @property
    def chunk_elems(self) -> int:
        """Chunk size in float32 elements (a half-precision ring fits twice as many)."""
        return self.chunk_bytes // _ELEMENT_BYTES
