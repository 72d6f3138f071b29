"""Publishing one rank's state to its host's sidecar: one copy into a reused shared-memory segment.

A fresh tmpfs file costs the kernel a zero-fill of every page (1 GiB published into a fresh
segment: 0.5 s here, into a reused one: 0.09 s; see `_allocate`), so the publisher keeps its
segments and their writable mappings across steps. The sidecar hands a segment back when retention
retires its snapshot and no reader still uses it (`snapshots`: the file is renamed to
`<name>.free`); the next `publish` claims it by giving it a new name and overwrites it. A segment
is written only while the sidecar does not serve it: before registration, or after it was handed
back. So a reader never sees a half-written snapshot, and a publisher that dies mid-copy leaves an
unregistered file nobody serves.

With retention R the steady state is R + 1 segments: R served, one being written. A segment the
sidecar dropped instead (`forget`, its stop, a registration whose answer was lost) is never
written again: the publisher unmaps it when it notices."""

from __future__ import annotations

import errno
import mmap
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from fthsdp.services.checkpoint.client_errors import InvalidArgumentError
from fthsdp.services.checkpoint.client_fetch import DTYPE_NAMES
from fthsdp.services.checkpoint.client_http import call_json
from fthsdp.services.checkpoint.client_manifest import (
    Layout,
    check_id,
    check_meta,
    check_rank,
    check_step,
    plan_layout,
)
from fthsdp.services.common.private_dir import default_shm_dir
from fthsdp.services.common.tokens import Token

FREE_SUFFIX = ".free"
"""How the sidecar names a segment it handed back (`snapshots.FREE_SUFFIX`)."""
DEFAULT_TIMEOUT = timedelta(seconds=10)


@dataclass(slots=True)
class _Segment:
    """One shm file of this publisher and its writable mapping (None when empty)."""

    name: str
    size: int
    inode: tuple[int, int]
    mapped: mmap.mmap | None

    def close(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None


class SnapshotPublisher:
    """Publishes one rank's state to the sidecar on its host: one copy into shared memory.

    `publish` copies the tensors (CPU or CUDA) into a segment under `shm_dir` — a flat raw-bytes
    layout, written through typed views over a mmap, no pickle — then registers the file name and
    layout with the sidecar, which serves it from then on (checksums, serving, retention). It
    returns as soon as the sidecar has accepted the registration; checksums happen later, in the
    sidecar's process. `shm_dir` must be the sidecar's configured shm dir (default
    `/dev/shm/fthsdp-<uid>`, as the sidecar's). With `reuse` (the default) segments handed back
    by the sidecar are overwritten instead of fresh ones created; `close()` unlinks those."""

    def __init__(
        self,
        base_url: str,
        token: Token | str,
        *,
        job: str,
        replica_id: str,
        rank: int,
        shm_dir: str | os.PathLike[str] | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        reuse: bool = True,
    ) -> None:
        self.base_url = base_url
        self.job = check_id("job", job)
        self.replica_id = check_id("replica", replica_id)
        self.rank = check_rank(rank)
        self.shm_dir = default_shm_dir() if shm_dir is None else Path(shm_dir)
        self.timeout = timeout
        self.reuse = reuse
        self._token = token if isinstance(token, Token) else Token(token)
        self._segments: list[_Segment] = []
        self.reused = 0
        """How many publishes overwrote a handed-back segment (the rest created one)."""

    def publish(
        self, step: int, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str | int]
    ) -> None:
        """Copies `tensors` into shared memory and registers them as snapshot `step`.

        Raises InvalidArgumentError for a dtype outside the allow-list, ConflictError when `step`
        is already published with different bytes, TimeoutError when the sidecar does not answer."""
        check_step(step)
        clean_meta = check_meta(meta)
        layout = plan_layout(
            [(name, _dtype_name(name, t), tuple(t.shape)) for name, t in tensors.items()]
        )
        name = self._name(step)
        segment = self._claim(name, layout.total_bytes) if self.reuse else None
        if segment is None:
            segment = self._create(name, layout.total_bytes)
        else:
            self.reused += 1
        try:
            if segment.mapped is not None:
                _copy_into(segment.mapped, layout, tensors)
            self._register(step, name, layout, clean_meta)
        except BaseException:
            # The sidecar may have adopted it all the same (an answer lost): never write it again.
            self._drop(segment, unlink=name)
            raise
        if self.reuse:
            self._segments.append(segment)
        else:
            segment.close()

    def forget_earlier(self) -> int:
        """Drops the snapshots earlier processes of this rank left in the sidecar, which
        outlives them; returns how many. Call it once per process, before the first `publish`:
        a snapshot is immutable per step, and an earlier process's step may be of another
        history (a job that went on from another replica, or from a durable checkpoint), which
        a peer must never fetch as this one's. The sidecar unlinks their files, handed-back
        segments included, so this publisher's segments are dropped too."""
        path = f"/v1/snapshots/{self.job}/{self.replica_id}/{self.rank}"
        answer = call_json(self.base_url, self._token, "DELETE", path, timeout=self.timeout)
        for segment in self._segments:
            segment.close()
        self._segments.clear()
        return int(answer["forgotten"])

    def close(self) -> None:
        """Unmaps every segment and unlinks those handed back (the sidecar owns the rest)."""
        for segment in self._segments:
            self._drop(segment, unlink=segment.name + FREE_SUFFIX)
        self._segments.clear()

    def _name(self, step: int) -> str:
        return (
            f"fthsdp-{self.job}-{self.replica_id}-r{self.rank}-s{step}-{secrets.token_hex(6)}.snap"
        )

    def _claim(self, name: str, size: int) -> _Segment | None:
        """A handed-back segment of `size` bytes, renamed to `name`; drops dead and spare ones."""
        claimed: _Segment | None = None
        for segment in list(self._segments):
            state = self._state(segment)
            if state == "served":
                continue
            self._segments.remove(segment)
            if state == "gone" or claimed is not None or segment.size != size:
                self._drop(segment, unlink=segment.name + FREE_SUFFIX if state == "free" else None)
                continue
            if self._rename(segment, name):
                claimed = segment
            else:
                segment.close()
        return claimed

    def _state(self, segment: _Segment) -> str:
        """served (the sidecar has it), free (handed back), or gone (dropped by the sidecar).

        The name is looked at first: the sidecar hands back by adding the free name before
        removing the other, so a segment is never seen with neither name while handed back."""
        for path, state in ((segment.name, "served"), (segment.name + FREE_SUFFIX, "free")):
            try:
                info = os.lstat(self.shm_dir / path)
            except FileNotFoundError:
                continue
            if (info.st_dev, info.st_ino) == segment.inode:
                return state
        return "gone"

    def _rename(self, segment: _Segment, name: str) -> bool:
        """Takes a handed-back segment under `name` (a new name, never replacing a file)."""
        free = self.shm_dir / (segment.name + FREE_SUFFIX)
        try:
            os.link(free, self.shm_dir / name)
        except FileNotFoundError:
            return False  # the sidecar unlinked it meanwhile (its forget or stop)
        info = os.lstat(self.shm_dir / name)
        if (info.st_dev, info.st_ino) != segment.inode:
            (self.shm_dir / name).unlink(missing_ok=True)
            return False
        free.unlink(missing_ok=True)
        segment.name = name
        return True

    def _create(self, name: str, size: int) -> _Segment:
        path = self.shm_dir / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            if size:
                _allocate(fd, size)
            info = os.fstat(fd)
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED) if size else None
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return _Segment(name, size, (info.st_dev, info.st_ino), mapped)

    def _drop(self, segment: _Segment, *, unlink: str | None) -> None:
        """Unmaps `segment`; unlinks `unlink` if that name is still this segment's file."""
        segment.close()
        if unlink is None:
            return
        path = self.shm_dir / unlink
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) == segment.inode:
            path.unlink(missing_ok=True)

    def _register(self, step: int, file: str, layout: Layout, meta: dict[str, str | int]) -> None:
        body = {
            "file": file,
            "total_bytes": layout.total_bytes,
            "tensors": [t.to_json() for t in layout.tensors],
            "meta": meta,
            "reuse": self.reuse,
        }
        path = f"/v1/snapshots/{self.job}/{self.replica_id}/{self.rank}/{step}"
        call_json(self.base_url, self._token, "POST", path, timeout=self.timeout, body=body)


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise InvalidArgumentError(f"tensor {name!r} has dtype {tensor.dtype}, not allowed")
    return dtype


def _allocate(fd: int, size: int) -> None:
    """Allocates the file's pages before it is mapped, without the GIL.

    Two reasons. A full tmpfs then fails here with ENOSPC, an OSError the caller can handle,
    instead of killing the process with SIGBUS when the copy touches a page that cannot be had.
    And the pages exist before the copy faults them in: allocating them is the slow part of a
    fresh segment (zeroing every page), and `posix_fallocate` does it with the GIL released.
    `mmap(MAP_POPULATE)` did it holding the GIL: 0.76 s for 1 GiB here, long enough on a busy
    host for the rank's heartbeat thread to miss its deadline and the health service to tear a
    healthy replica down. With the pages allocated, the copy's faults only map them (1 GiB:
    0.66 s created and copied, against 0.83 s with MAP_POPULATE)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise  # ENOSPC above all
        # A file system without fallocate: the copy's first touch allocates each page.


def _copy_into(mapped: mmap.mmap, layout: Layout, tensors: Mapping[str, torch.Tensor]) -> None:
    """The one copy: each source tensor into its typed view of the mapped segment."""
    with torch.no_grad():
        for entry in layout.tensors:
            if entry.nbytes == 0:
                continue
            src = tensors[entry.name]
            dst = torch.frombuffer(mapped, dtype=src.dtype, count=src.numel(), offset=entry.offset)
            dst.view(src.shape).copy_(src)
            del dst  # the mapping can be closed only once no view exports it
