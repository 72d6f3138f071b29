"""The sidecar's published snapshots: shm files it owns, checksums computed off the training path.

A registration names a plain file in the configured shm dir; the sidecar opens it without following
links, checks its size against the declared layout, maps it read-only (for checksums and durable
writes), keeps the descriptor (responses `sendfile` from it), queues the checksum job on its own
threads, and answers at once. The snapshot is immutable from then on.

Every reader of a snapshot's bytes holds a `Lease`: the checksum job, a durable write, and a data
response until its client has read it (`zerocopy`). Retention retires older snapshots. A retired
file registered with `reuse` is handed back to its publisher once its last lease ends: renamed to
`<file>.free` (a second name, then the first removed, so an existing name is never replaced), which
the publisher claims and overwrites for a later step instead of zero-filling a fresh file. Until
then nobody writes it, so a reader never sees a snapshot being overwritten. Other retired files are
unlinked at once (a mapping or descriptor still in use stays valid until dropped).

The sidecar deletes or renames only what it took ownership of: a file of this user with no other
name (one link), held by one snapshot only (one file, one key), and at that moment still the same
file (its inode) as the one adopted, so a name reused meanwhile is left alone. Handed-back files are
remembered until claimed, and unlinked by `forget` of their rank and at `close`."""

from __future__ import annotations

import io
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from fthsdp.services.checkpoint.client_errors import (
    ConflictError,
    GoneError,
    InvalidArgumentError,
    NotFoundError,
)
from fthsdp.services.checkpoint.client_manifest import (
    Layout,
    Manifest,
    TensorEntry,
    check_id,
    check_meta,
    check_rank,
    check_step,
)
from fthsdp.services.checkpoint.config import CheckpointConfig
from fthsdp.services.checkpoint.core import steps_to_collect
from fthsdp.services.common.crc import crc32

log = logging.getLogger(__name__)

_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,249}$")
FREE_SUFFIX = ".free"
"""A handed-back file's name: its registered name plus this (names are ≤ 250 chars, so it fits)."""
Key = tuple[str, str, int]
FileId = tuple[int, int]
"""(st_dev, st_ino): the adopted file itself, whatever its name points to later."""


@dataclass(slots=True)
class Snapshot:
    """One registered snapshot: its mapping, layout and (eventually) its chunk checksums."""

    job: str
    replica: str
    rank: int
    step: int
    file: str
    layout: Layout
    meta: dict[str, str | int]
    chunk_bytes: int
    data: memoryview
    file_id: FileId = (0, 0)
    source: io.FileIO | None = None
    """The open file, for `sendfile`; None for an empty snapshot. Closed once retired and unused."""
    reuse: bool = False
    """Hand the file back to the publisher when retired, instead of unlinking it."""
    checksums: Future[tuple[int, ...]] = field(default_factory=Future)
    users: int = 0
    retired: bool = False

    def manifest(self, world_size: int | None = None) -> Manifest:
        """The manifest; only call once `checksums` is done."""
        return Manifest(
            job=self.job,
            replica=self.replica,
            rank=self.rank,
            step=self.step,
            world_size=world_size,
            layout=self.layout,
            chunk_bytes=self.chunk_bytes,
            checksums=self.checksums.result(),
            meta=self.meta,
        )


def compute_checksums(data: memoryview, chunk_bytes: int) -> tuple[int, ...]:
    return tuple(crc32(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes))


class Lease:
    """A hold on a snapshot's bytes: while one is open, its file is not handed back for reuse.

    `release` is idempotent and may be called from any thread."""

    def __init__(self, registry: SnapshotRegistry, snap: Snapshot) -> None:
        self.snapshot = snap
        self._registry: SnapshotRegistry | None = registry

    def release(self) -> None:
        registry, self._registry = self._registry, None
        if registry is not None:
            registry._release(self.snapshot)


class SnapshotRegistry:
    """Registered snapshots by (job, replica, rank) and step, with retention."""

    def __init__(
        self, config: CheckpointConfig, on_checksums: Callable[[float], None] | None = None
    ) -> None:
        self.config = config
        self._on_checksums = on_checksums
        self._lock = threading.Lock()
        self._snapshots: dict[Key, dict[int, Snapshot]] = {}
        self._collected_upto: dict[Key, int] = {}
        self._owners: dict[FileId, tuple[Key, int]] = {}
        """Adopted file -> the one snapshot (key, step) that holds it."""
        self._handed_back: dict[FileId, tuple[Key, str]] = {}
        """Files renamed for their publisher to reuse and not registered again (yet): the key
        and the name they were handed back under, for `forget` and `close` to unlink."""
        self._pool = ThreadPoolExecutor(config.checksum_threads, thread_name_prefix="fthsdp-crc")
        self.collected = 0

    def register(
        self,
        job: str,
        replica: str,
        rank: int,
        step: int,
        *,
        file: str,
        total_bytes: int,
        tensors: Sequence[TensorEntry],
        meta: dict[str, str | int],
        reuse: bool = False,
    ) -> tuple[Snapshot, bool]:
        """Adopts the shm file as snapshot `step`; returns it and whether it is new.

        Registering the same file again is a no-op (a retried request); another file for a
        published step, or a file another snapshot holds, is a ConflictError; a step older than
        those retained a GoneError. With `reuse`, the file is handed back when retired."""
        key = (check_id("job", job), check_id("replica", replica), check_rank(rank))
        check_step(step)
        layout = Layout(tuple(tensors), total_bytes)
        layout.check(self.config.max_snapshot_bytes)
        clean_meta = check_meta(meta)
        with self._lock:
            existing = self._snapshots.get(key, {}).get(step)
            if existing is not None:
                if existing.file == file:
                    return existing, False
                raise ConflictError(f"step {step} of {key} is already published (immutable)")
            if step <= self._collected_upto.get(key, -1):
                raise GoneError(f"step {step} of {key} is older than the retained snapshots")
        data, file_id, source = self._map(file, total_bytes)
        snap = Snapshot(
            *key, step, file, layout, clean_meta, self.config.chunk_bytes, data, file_id, source,
            reuse, users=1,  # the checksum job's lease
        )  # fmt: skip
        try:
            with self._lock:
                steps = self._snapshots.setdefault(key, {})
                if step in steps:
                    raise ConflictError(f"step {step} of {key} is already published (immutable)")
                holder = self._owners.get(file_id)
                if holder is not None:
                    raise ConflictError(
                        f"{file!r} is already step {holder[1]} of {holder[0]}: one file holds "
                        "one snapshot"
                    )
                steps[step] = snap
                self._owners[file_id] = (key, step)
                self._handed_back.pop(file_id, None)
                doomed = [
                    steps.pop(s) for s in steps_to_collect(steps, self.config.retain_snapshots)
                ]
                for old in doomed:
                    self._collected_upto[key] = max(self._collected_upto.get(key, -1), old.step)
                    self._owners.pop(old.file_id, None)
        except BaseException:
            if source is not None:
                source.close()
            raise
        for old in doomed:
            self._retire(old, hand_back=old.reuse)
        if snap in doomed:
            self._release(snap)
            raise GoneError(f"step {step} of {key} is older than the retained snapshots")
        self._pool.submit(self._checksum, snap)
        return snap, True

    def lease(self, job: str, replica: str, rank: int, step: int) -> Lease:
        """A lease on a served snapshot (NotFoundError / GoneError as `get`)."""
        with self._lock:
            snap = self._find(job, replica, rank, step)
            snap.users += 1
        return Lease(self, snap)

    def _release(self, snap: Snapshot) -> None:
        with self._lock:
            snap.users -= 1
            last = snap.users == 0 and snap.retired
        if last:
            self._finish(snap)

    def _retire(self, snap: Snapshot, *, hand_back: bool) -> None:
        """No longer served: unlinked now, or handed back once its last lease ends."""
        with self._lock:
            snap.retired = True
            snap.reuse = hand_back
            unused = snap.users == 0
        if not hand_back:
            self._unlink(snap)
        if unused:
            self._finish(snap)

    def _finish(self, snap: Snapshot) -> None:
        """The retired snapshot's last user is gone: close it, and hand its file back."""
        if snap.source is not None:
            snap.source.close()
        if snap.reuse:
            self._hand_back(snap)

    def _map(self, file: str, total_bytes: int) -> tuple[memoryview, FileId, io.FileIO | None]:
        if not _FILE.match(file) or ".." in file:
            raise InvalidArgumentError("file must be a plain file name inside the shm dir")
        try:
            # O_NONBLOCK: opening a FIFO for reading would block until a writer came (a
            # registration naming one held a worker thread for good); fstat refuses it below.
            fd = os.open(self.config.shm_dir / file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot open {file!r} in the shm dir: {exc.strerror}"
            ) from exc
        keep = False
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgumentError(f"{file!r} is not a regular file")
            if info.st_uid != os.getuid() or info.st_nlink != 1:
                # Adopting means deleting it later: only a publisher's own file, with no other
                # name that would keep (or be) something else.
                raise InvalidArgumentError(
                    f"{file!r} is not a publisher's file: it must belong to this user and have "
                    "exactly one name"
                )
            if info.st_size != total_bytes:
                raise InvalidArgumentError(
                    f"{file!r} has {info.st_size} bytes, the layout declares {total_bytes}"
                )
            file_id = (info.st_dev, info.st_ino)
            if total_bytes == 0:
                return memoryview(b""), file_id, None
            # No MAP_POPULATE here: faulting pages in would delay the registration answer; the
            # checksum pass touches every page anyway, off the publisher's path.
            data = memoryview(mmap.mmap(fd, total_bytes, access=mmap.ACCESS_READ))
            # Blocking again: `sendfile` reads through it (the FIFO case is refused above).
            os.set_blocking(fd, True)
            keep = True
            return data, file_id, io.FileIO(fd, "rb", closefd=True)
        finally:
            if not keep:
                os.close(fd)

    def _checksum(self, snap: Snapshot) -> None:
        start = time.perf_counter()
        try:
            snap.checksums.set_result(compute_checksums(snap.data, snap.chunk_bytes))
        except BaseException as exc:
            log.exception("checksums of %s step %d failed", snap.file, snap.step)
            snap.checksums.set_exception(exc)
            return
        finally:
            self._release(snap)
        if self._on_checksums is not None:
            self._on_checksums(time.perf_counter() - start)

    def _still_adopted(self, snap: Snapshot, path: os.PathLike[str] | str) -> bool:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            log.warning("snapshot file %s was already gone", snap.file)
            return False
        if (info.st_dev, info.st_ino) != snap.file_id:
            log.warning("snapshot file %s was replaced meanwhile: left alone", snap.file)
            return False
        return True

    def _unlink(self, snap: Snapshot) -> None:
        self.collected += 1
        path = self.config.shm_dir / snap.file
        if self._still_adopted(snap, path):
            path.unlink(missing_ok=True)

    def _hand_back(self, snap: Snapshot) -> None:
        self.collected += 1
        path = self.config.shm_dir / snap.file
        free = self.config.shm_dir / (snap.file + FREE_SUFFIX)
        if not self._still_adopted(snap, path):
            return
        key = (snap.job, snap.replica, snap.rank)
        with self._lock:
            self._handed_back[snap.file_id] = (key, free.name)
        try:
            os.link(path, free)  # fails rather than replace a file of that name
        except OSError as exc:
            log.warning("%s not handed back (unlinked instead): %s", snap.file, exc)
            with self._lock:
                self._handed_back.pop(snap.file_id, None)
        path.unlink(missing_ok=True)

    def _unlink_handed_back(self, entries: Sequence[tuple[FileId, str]]) -> None:
        """Unlinks handed-back files the publisher did not claim (still of the same inode)."""
        for file_id, name in entries:
            path = self.config.shm_dir / name
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                continue  # claimed: the publisher's now
            if (info.st_dev, info.st_ino) == file_id:
                path.unlink(missing_ok=True)

    def _find(self, job: str, replica: str, rank: int, step: int) -> Snapshot:
        key = (job, replica, rank)
        snap = self._snapshots.get(key, {}).get(step)
        if snap is not None:
            return snap
        if step <= self._collected_upto.get(key, -1):
            raise GoneError(
                f"step {step} of {job}/{replica}/rank {rank} was garbage-collected; "
                f"available: {sorted(self._snapshots.get(key, {}))}"
            )
        raise NotFoundError(f"no snapshot of step {step} for {job}/{replica}/rank {rank}")

    def get(self, job: str, replica: str, rank: int, step: int) -> Snapshot:
        with self._lock:
            return self._find(job, replica, rank, step)

    def forget(self, job: str, replica: str, rank: int) -> int:
        """Drops every snapshot of (job, replica, rank) and what was collected of it; returns how
        many were dropped. A new process of that rank calls it before publishing: the sidecar
        outlives processes, and an earlier one's snapshots may be of another history (a job that
        went on from another replica's state, or from a durable checkpoint) under the same steps."""
        key = (check_id("job", job), check_id("replica", replica), check_rank(rank))
        with self._lock:
            dropped = list(self._snapshots.pop(key, {}).values())
            self._collected_upto.pop(key, None)
            for snap in dropped:
                self._owners.pop(snap.file_id, None)
            spare = [(f, n) for f, (k, n) in self._handed_back.items() if k == key]
            for file_id, _ in spare:
                del self._handed_back[file_id]
        for snap in dropped:
            self._retire(snap, hand_back=False)
        self._unlink_handed_back(spare)
        return len(dropped)

    def steps(self, job: str, replica: str, rank: int) -> list[int]:
        with self._lock:
            return sorted(self._snapshots.get((job, replica, rank), {}))

    def close(self) -> None:
        """Stops the checksum threads and unlinks every file the sidecar owns."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            snaps = [s for steps in self._snapshots.values() for s in steps.values()]
            self._snapshots.clear()
            self._owners.clear()
            spare = [(f, n) for f, (_, n) in self._handed_back.items()]
            self._handed_back.clear()
        for snap in snaps:
            if not snap.checksums.done():
                snap.checksums.cancel()
            self._retire(snap, hand_back=False)
            if snap.source is not None:
                snap.source.close()  # the server has stopped: whatever still leases it is gone
        self._unlink_handed_back(spare)
