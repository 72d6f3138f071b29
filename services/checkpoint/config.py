"""Configuration of the checkpoint sidecar (flags and FTHSDP_* env are read only by __main__)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from fthsdp.services.common.private_dir import default_shm_dir

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Everything the checkpoint sidecar needs to run; validated on construction."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise (ranks reach their own host's sidecar)."""
    port: int = 0
    """TCP port; 0 picks a free one (the server exposes the real address)."""
    shm_dir: Path = field(default_factory=default_shm_dir)
    """Where publishers put snapshot files; registrations name plain files inside it only. It
    must be private to this user: created with mode 0700 if missing, refused at start when it
    belongs to another user or others may write to it (default `/dev/shm/fthsdp-<uid>`)."""
    durable_root: Path = Path("./fthsdp-checkpoints")
    """Root of durable checkpoints (`<root>/<job>/step-<step>/rank-<rank>/`) and data positions."""
    retain_snapshots: int = 2
    """Published steps kept per (job, replica, rank); older ones are unlinked from shm."""
    retain_checkpoints: int = 3
    """Complete durable steps kept per job; older steps and stale partial ones are deleted."""
    chunk_bytes: int = 4 * MIB
    """Checksum chunk size; also the fetchers' stripe unit."""
    max_range_bytes: int = 256 * MIB
    """Largest byte range one data request may ask for. Responses go out without a Python copy
    (`zerocopy`) or in `stream_bytes` pieces, so this bounds a request's time, not memory."""
    max_body_bytes: int = 16 * MIB
    """Largest request body (a registration of many tensors), refused before it is read."""
    max_snapshot_bytes: int = 1 << 40
    """Largest snapshot a registration may declare."""
    stream_bytes: int = 1 * MIB
    """Size of the pieces a data response is written in (bounds the memory per response)."""
    send_with: str = "write"
    """How snapshot bytes go out, neither with a Python copy (`zerocopy`): "write" (the kernel
    copies from the mapping into the socket) or "sendfile" (the kernel sends the shm pages
    themselves: no copy on the source). On loopback and veth (one host, the dev stack, the netns
    demo) "write" measured cheaper in total: with "sendfile" the receiver copies from pages no
    cache has seen (bench.checkpoint: 0.33 vs 0.57 CPU-s/GB). Across hosts "sendfile" spares the
    serving replica its copy."""
    checksum_threads: int = 2
    """Threads computing snapshot checksums in the sidecar's process."""
    checksum_wait: timedelta = timedelta(seconds=30)
    """How long a manifest request waits for pending checksums before answering 503."""
    shutdown_grace: timedelta = timedelta(seconds=5)
    """How long stop() drains open requests and durable writes before cancelling them."""
    log_level: str = "warning"
    """uvicorn's log level (access logs are off below 'info')."""
    redis_url: str | None = None
    """Keep data-position records in Redis (`redis://[:password@]host:port/db`), shared by every
    sidecar of the job; None: fsync'd files under `durable_root/positions` on this host."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.retain_snapshots < 1 or self.retain_checkpoints < 1:
            raise ValueError("retain_snapshots and retain_checkpoints must be at least 1")
        if not 4096 <= self.chunk_bytes <= 1024 * MIB:
            raise ValueError(f"chunk_bytes must be in 4 KiB..1 GiB, got {self.chunk_bytes}")
        if self.max_range_bytes < self.chunk_bytes:
            raise ValueError("max_range_bytes must be at least chunk_bytes")
        if not 4096 <= self.stream_bytes <= self.max_range_bytes:
            raise ValueError("stream_bytes must be in 4 KiB..max_range_bytes")
        if self.max_body_bytes < 4096 or self.max_snapshot_bytes < 0:
            raise ValueError("max_body_bytes must be at least 4 KiB")
        if self.send_with not in ("sendfile", "write"):
            raise ValueError(f"send_with must be sendfile or write, got {self.send_with!r}")
        if self.checksum_threads < 1:
            raise ValueError("checksum_threads must be at least 1")
        if self.checksum_wait <= timedelta(0) or self.shutdown_grace < timedelta(0):
            raise ValueError("checksum_wait must be positive and shutdown_grace non-negative")
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"unknown log level {self.log_level!r}")
