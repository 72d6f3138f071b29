"""Durable checkpoints: atomic per-rank directories, verification, restore choice and retention.

Layout: `<root>/<job>/step-<step:012d>/rank-<rank>/{manifest.json,data.bin}`. A rank directory is
written under a temp name in the same parent, every file and the directory fsync'd, then renamed
into place, so a crash leaves either the whole rank or an ignored `.tmp-*` directory. A step is
complete when all `world_size` rank directories exist; it is restorable when they also verify
(manifest valid, sizes match, every chunk's CRC matches). Writes run on one background thread, so
neither training nor the HTTP loop waits on the disk."""

from __future__ import annotations

import json
import logging
import mmap
import os
import queue
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fthsdp.services.checkpoint.client_errors import CheckpointError, CorruptionError, NotFoundError
from fthsdp.services.checkpoint.client_manifest import Manifest, check_id
from fthsdp.services.checkpoint.core import (
    checkpoint_steps_to_delete,
    choose_latest,
    parse_rank_dir,
    parse_step_dir,
    rank_dir_name,
    step_dir_name,
)
from fthsdp.services.common.crc import crc32

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DATA = "data.bin"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_WRITE_BYTES = 8 << 20
_MAX_TRACKED = 4096


@dataclass(frozen=True, slots=True)
class WriteStatus:
    """Where one durable write stands: queued, writing, done or failed (with why)."""

    state: str
    detail: str = ""


class DurableStore:
    """The durable checkpoint tree under `root` (one writer per rank, readers anywhere)."""

    def __init__(self, root: Path, *, retain: int, max_bytes: int) -> None:
        self.root = root
        self.retain = retain
        self.max_bytes = max_bytes
        self._verified: dict[tuple[str, int, int], tuple[object, str | None]] = {}
        self._lock = threading.Lock()

    def rank_dir(self, job: str, step: int, rank: int) -> Path:
        return self.root / check_id("job", job) / step_dir_name(step) / rank_dir_name(rank)

    def write(self, manifest: Manifest, data: memoryview) -> None:
        """Writes one rank atomically; re-verifies the bytes against the manifest on the way."""
        final = self.rank_dir(manifest.job, manifest.step, manifest.rank)
        step_dir = final.parent
        created = not step_dir.exists()
        step_dir.mkdir(parents=True, exist_ok=True)
        if created:
            _fsync_dir(step_dir.parent)
        tmp = step_dir / f".tmp-{final.name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _write_data(tmp / DATA, data, manifest)
            _write_file(tmp / MANIFEST, json.dumps(manifest.to_json()).encode())
            _fsync_dir(tmp)
            if final.exists():
                _discard(final)
            tmp.rename(final)
            _fsync_dir(step_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def verify_rank(self, job: str, step: int, rank: int, world_size: int | None) -> str | None:
        """Why (job, step, rank) is not restorable, or None when it verifies. Cached per file
        identity (inode, size, mtime), so a rewrite or corruption by a write is seen again."""
        directory = self.rank_dir(job, step, rank)
        try:
            identity = tuple(
                (s.st_ino, s.st_size, s.st_mtime_ns)
                for s in (os.stat(directory / MANIFEST), os.stat(directory / DATA))
            )
        except FileNotFoundError:
            return f"rank {rank} is missing"
        key = (job, step, rank)
        with self._lock:
            cached = self._verified.get(key)
        if cached is not None and cached[0] == identity:
            failure = cached[1]
        else:
            failure = self._verify_files(directory, job, step, rank)
            with self._lock:
                self._verified[key] = (identity, failure)
        if failure is None and world_size is not None:
            manifest = self.read_manifest(job, step, rank)
            if manifest.world_size != world_size:
                return f"rank {rank} was written for world_size {manifest.world_size}"
        return failure

    def _verify_files(self, directory: Path, job: str, step: int, rank: int) -> str | None:
        try:
            manifest = self.read_manifest(job, step, rank)
        except CheckpointError as exc:
            return f"rank {rank}: {exc}"
        if (manifest.job, manifest.step, manifest.rank) != (job, step, rank):
            return f"rank {rank}: manifest names another job, step or rank"
        size = (directory / DATA).stat().st_size
        if size != manifest.layout.total_bytes:
            total = manifest.layout.total_bytes
            return f"rank {rank}: data.bin has {size} bytes, manifest says {total}"
        with _mapped(directory / DATA, size) as data:
            for index, expected in enumerate(manifest.checksums):
                at = index * manifest.chunk_bytes
                if crc32(data[at : at + manifest.chunk_bytes]) != expected:
                    return f"rank {rank}: chunk {index} of data.bin fails its checksum"
        return None

    def read_manifest(self, job: str, step: int, rank: int) -> Manifest:
        path = self.rank_dir(job, step, rank) / MANIFEST
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError as exc:
            raise NotFoundError(f"no durable checkpoint of {job} step {step} rank {rank}") from exc
        try:
            return Manifest.from_json(json.loads(raw), max_total_bytes=self.max_bytes)
        except ValueError as exc:
            raise CorruptionError(f"unreadable manifest of {job} step {step}: {exc}") from exc

    def open_data(self, job: str, step: int, rank: int) -> tuple[Manifest, memoryview]:
        """The manifest and a read-only view of data.bin, for serving a restore."""
        manifest = self.read_manifest(job, step, rank)
        path = self.rank_dir(job, step, rank) / DATA
        size = path.stat().st_size
        if size != manifest.layout.total_bytes:
            raise CorruptionError(f"data.bin of {job} step {step} rank {rank} has the wrong size")
        if size == 0:
            return manifest, memoryview(b"")
        with path.open("rb") as f:
            return manifest, memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))

    def steps(self, job: str) -> list[int]:
        job_dir = self.root / check_id("job", job)
        if not job_dir.is_dir():
            return []
        found = (parse_step_dir(p.name) for p in job_dir.iterdir() if p.is_dir())
        return sorted(s for s in found if s is not None)

    def ranks(self, job: str, step: int) -> list[int]:
        step_dir = self.root / job / step_dir_name(step)
        found = (parse_rank_dir(p.name) for p in step_dir.iterdir()) if step_dir.is_dir() else ()
        return sorted(r for r in found if r is not None)

    def step_failure(self, job: str, step: int, world_size: int | None) -> str | None:
        """Why `step` cannot be restored (missing or bad ranks), or None when it can."""
        if world_size is None:
            try:
                world_size = self.read_manifest(job, step, 0).world_size
            except CheckpointError as exc:
                return str(exc)
        for rank in range(world_size or 1):
            failure = self.verify_rank(job, step, rank, world_size)
            if failure is not None:
                return failure
        return None

    def latest(self, job: str, world_size: int | None) -> tuple[int | None, str]:
        """The newest restorable step, and a reason naming the skipped newer ones."""
        candidates: list[tuple[int, str | None]] = []
        for step in reversed(self.steps(job)):
            failure = self.step_failure(job, step, world_size)
            candidates.append((step, failure))
            if failure is None:
                break
            log.warning("durable step %d of %s is not restorable: %s", step, job, failure)
        return choose_latest(candidates)

    def is_complete(self, job: str, step: int) -> bool:
        """All ranks present (cheap: directory listing + one manifest, no checksums)."""
        try:
            world_size = self.read_manifest(job, step, self.ranks(job, step)[0]).world_size
        except (CheckpointError, IndexError):
            return False
        return world_size is not None and set(range(world_size)) <= set(self.ranks(job, step))

    def apply_retention(self, job: str) -> list[int]:
        """Deletes complete steps beyond `retain` and older abandoned partial steps."""
        complete = {step: self.is_complete(job, step) for step in self.steps(job)}
        doomed, why = checkpoint_steps_to_delete(complete, self.retain)
        for step in doomed:
            _discard(self.root / job / step_dir_name(step))
            log.info("deleted durable step %d of %s (%s)", step, job, why)
        return doomed


class DurableWriter:
    """One background thread that persists snapshots; statuses are kept for the last writes."""

    def __init__(self, store: DurableStore, on_write: Callable[[str, float], None]) -> None:
        self.store = store
        self._on_write = on_write
        self._queue: queue.Queue[
            tuple[tuple[str, int, int], Callable[[], Manifest], memoryview, Callable[[], None]]
            | None
        ]
        self._queue = queue.Queue()
        self._status: OrderedDict[tuple[str, int, int], WriteStatus] = OrderedDict()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fthsdp-durable", daemon=True)
        self._thread.start()

    def submit(
        self,
        key: tuple[str, int, int],
        manifest: Callable[[], Manifest],
        data: memoryview,
        on_done: Callable[[], None] = lambda: None,
    ) -> WriteStatus:
        """Queues a write unless one for `key` is already queued, running or done; `on_done`
        runs once `data` is no longer read (at once when nothing was queued)."""
        with self._lock:
            current = self._status.get(key)
            if current is not None and current.state in ("queued", "writing", "done"):
                on_done()
                return current
            self._set(key, WriteStatus("queued"))
        self._queue.put((key, manifest, data, on_done))
        return WriteStatus("queued")

    def _set(self, key: tuple[str, int, int], status: WriteStatus) -> None:
        self._status[key] = status
        self._status.move_to_end(key)
        while len(self._status) > _MAX_TRACKED:
            self._status.popitem(last=False)

    def status(self, key: tuple[str, int, int]) -> WriteStatus:
        with self._lock:
            tracked = self._status.get(key)
        if tracked is not None:
            return tracked
        job, step, rank = key
        if (self.store.rank_dir(job, step, rank) / MANIFEST).exists():
            return WriteStatus("done", "found on disk")
        raise NotFoundError(f"no durable write of {job} step {step} rank {rank} was requested")

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, manifest, data, on_done = item
            with self._lock:
                self._set(key, WriteStatus("writing"))
            start = time.perf_counter()
            try:
                self.store.write(manifest(), data)
                self.store.apply_retention(key[0])
                status, outcome = WriteStatus("done"), "done"
            except Exception as exc:
                log.exception("durable write of %s step %d rank %d failed", *key)
                status, outcome = WriteStatus("failed", f"{type(exc).__name__}: {exc}"), "failed"
            finally:
                on_done()
            with self._lock:
                self._set(key, status)
            self._on_write(outcome, time.perf_counter() - start)

    def close(self, grace: float) -> None:
        """Lets queued writes finish for up to `grace` seconds; later ones are abandoned (their
        temp directories are ignored by readers and removed by retention)."""
        self._queue.put(None)
        self._thread.join(grace)


def _write_data(path: Path, data: memoryview, manifest: Manifest) -> None:
    chunk = manifest.chunk_bytes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        for index, expected in enumerate(manifest.checksums):
            piece = data[index * chunk : (index + 1) * chunk]
            if crc32(piece) != expected:
                raise CorruptionError(f"chunk {index} changed since it was checksummed")
            for at in range(0, len(piece), _WRITE_BYTES):
                _write_all(fd, piece[at : at + _WRITE_BYTES])
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, content: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        _write_all(fd, memoryview(content))
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Removes a directory: renamed aside first (atomic), so readers never see it half-deleted."""
    trash = path.parent / f".trash-{path.name}-{secrets.token_hex(4)}"
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


class _mapped:
    """A read-only mapping of a file as a memoryview, released on exit."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self._map: mmap.mmap | None = None

    def __enter__(self) -> memoryview:
        if self.size == 0:
            return memoryview(b"")
        with self.path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_READ)
        return memoryview(self._map)

    def __exit__(self, *exc: object) -> None:
        self._map = None
