"""What a training process uses of the checkpoint service: publish, fetch, durable, positions.

All of it talks to a sidecar over HTTP; nothing here starts a server. Callers see typed errors from
`client_errors` (and TimeoutError), never HTTP types. Every call has a timeout and retries transport
errors and 503s with exponential backoff + jitter inside it."""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from fthsdp.services.checkpoint.client_errors import (
    CheckpointError,
    InvalidArgumentError,
    NotFoundError,
)
from fthsdp.services.checkpoint.client_fetch import (
    DTYPE_NAMES,
    FetchedSnapshot,
    Source,
    SourceStats,
    fetch_checkpoint,
    fetch_snapshot,
    restore_latest,
)
from fthsdp.services.checkpoint.client_http import call_json
from fthsdp.services.checkpoint.client_manifest import (
    Layout,
    check_id,
    check_meta,
    check_rank,
    check_step,
    plan_layout,
)
from fthsdp.services.common.backoff import Backoff, sleep_before_retry
from fthsdp.services.common.private_dir import default_shm_dir
from fthsdp.services.common.tokens import Token

__all__ = [
    "DurableStatus",
    "FetchedSnapshot",
    "PositionRecord",
    "SnapshotPublisher",
    "Source",
    "SourceStats",
    "durable_status",
    "fetch_checkpoint",
    "fetch_snapshot",
    "get_position",
    "latest_checkpoint",
    "list_snapshots",
    "put_position",
    "request_durable",
    "restore_latest",
    "wait_durable",
]

DEFAULT_TIMEOUT = timedelta(seconds=10)


def _token(token: Token | str) -> Token:
    return token if isinstance(token, Token) else Token(token)


class SnapshotPublisher:
    """Publishes one rank's state to the sidecar on its host: one copy into shared memory.

    `publish` copies the tensors (CPU or CUDA) into a new file under `shm_dir` — a flat raw-bytes
    layout, written through typed views over a mmap, no pickle — then registers the file name and
    layout with the sidecar, which owns the file from then on (checksums, serving, retention). It
    returns as soon as the sidecar has accepted the registration; checksums happen later, in the
    sidecar's process. `shm_dir` must be the sidecar's configured shm dir (default
    `/dev/shm/fthsdp-<uid>`, as the sidecar's)."""

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
    ) -> None:
        self.base_url = base_url
        self.job = check_id("job", job)
        self.replica_id = check_id("replica", replica_id)
        self.rank = check_rank(rank)
        self.shm_dir = default_shm_dir() if shm_dir is None else Path(shm_dir)
        self.timeout = timeout
        self._token = _token(token)

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
        name = (
            f"fthsdp-{self.job}-{self.replica_id}-r{self.rank}-s{step}-{secrets.token_hex(6)}.snap"
        )
        path = self.shm_dir / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.ftruncate(fd, layout.total_bytes)
                if layout.total_bytes:
                    _copy_into(fd, layout, tensors)
            finally:
                os.close(fd)
            self._register(step, name, layout, clean_meta)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def forget_earlier(self) -> int:
        """Drops the snapshots earlier processes of this rank left in the sidecar, which
        outlives them; returns how many. Call it once per process, before the first `publish`:
        a snapshot is immutable per step, and an earlier process's step may be of another
        history (a job that went on from another replica, or from a durable checkpoint), which
        a peer must never fetch as this one's."""
        path = f"/v1/snapshots/{self.job}/{self.replica_id}/{self.rank}"
        answer = call_json(self.base_url, self._token, "DELETE", path, timeout=self.timeout)
        return int(answer["forgotten"])

    def _register(self, step: int, file: str, layout: Layout, meta: dict[str, str | int]) -> None:
        body = {
            "file": file,
            "total_bytes": layout.total_bytes,
            "tensors": [t.to_json() for t in layout.tensors],
            "meta": meta,
        }
        path = f"/v1/snapshots/{self.job}/{self.replica_id}/{self.rank}/{step}"
        call_json(self.base_url, self._token, "POST", path, timeout=self.timeout, body=body)


def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise InvalidArgumentError(f"tensor {name!r} has dtype {tensor.dtype}, not allowed")
    return dtype


def _copy_into(fd: int, layout: Layout, tensors: Mapping[str, torch.Tensor]) -> None:
    """The one copy: each source tensor into its typed view of the mapped file."""
    # MAP_POPULATE faults every page in up front, in the kernel: 2-3x faster than first-touch
    # faults during the copy (measured 0.38 s → 0.14 s for 250 MB on tmpfs).
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapped = mmap.mmap(fd, layout.total_bytes, flags=flags)
    try:
        with torch.no_grad():
            for entry in layout.tensors:
                if entry.nbytes == 0:
                    continue
                src = tensors[entry.name]
                dst = torch.frombuffer(
                    mapped, dtype=src.dtype, count=src.numel(), offset=entry.offset
                )
                dst.view(src.shape).copy_(src)
                del dst
    finally:
        mapped.close()


def list_snapshots(
    url: str,
    token: Token | str,
    *,
    job: str,
    replica: str,
    rank: int,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> list[int]:
    """The steps a sidecar currently serves for (job, replica, rank), oldest first."""
    path = f"/v1/snapshots/{check_id('job', job)}/{check_id('replica', replica)}/{check_rank(rank)}"
    return [int(s) for s in call_json(url, _token(token), "GET", path, timeout=timeout)["steps"]]


@dataclass(frozen=True, slots=True)
class DurableStatus:
    """Where a durable write of one rank's snapshot stands: queued, writing, done or failed."""

    state: str
    detail: str


def request_durable(
    url: str,
    token: Token | str,
    *,
    job: str,
    replica: str,
    rank: int,
    step: int,
    world_size: int,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> DurableStatus:
    """Asks the sidecar to persist an already-published snapshot; returns once it is queued."""
    body = {
        "job": check_id("job", job),
        "replica": check_id("replica", replica),
        "rank": check_rank(rank, world_size),
        "step": check_step(step),
        "world_size": world_size,
    }
    raw = call_json(url, _token(token), "POST", "/v1/checkpoints", timeout=timeout, body=body)
    return DurableStatus(str(raw["state"]), str(raw.get("detail", "")))


def durable_status(
    url: str,
    token: Token | str,
    *,
    job: str,
    step: int,
    rank: int,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> DurableStatus:
    """The state of the durable write of (job, step, rank); NotFoundError if never requested."""
    path = f"/v1/checkpoints/{check_id('job', job)}/{check_step(step)}/{check_rank(rank)}/status"
    raw = call_json(url, _token(token), "GET", path, timeout=timeout)
    return DurableStatus(str(raw["state"]), str(raw.get("detail", "")))


def wait_durable(
    url: str, token: Token | str, *, job: str, step: int, rank: int, timeout: timedelta
) -> DurableStatus:
    """Polls until the durable write of (job, step, rank) is done.

    Raises CheckpointError when the write failed, TimeoutError when `timeout` passes first."""
    deadline = time.monotonic() + timeout.total_seconds()
    delays = Backoff(
        initial=timedelta(milliseconds=10), maximum=timedelta(milliseconds=500)
    ).delays()
    while True:
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        status = durable_status(url, token, job=job, step=step, rank=rank, timeout=left)
        if status.state == "done":
            return status
        if status.state == "failed":
            raise CheckpointError(
                f"durable write of {job} step {step} rank {rank}: {status.detail}"
            )
        if not sleep_before_retry(delays, deadline):
            raise TimeoutError(f"durable write of {job} step {step} rank {rank} is {status.state}")


def latest_checkpoint(
    url: str, token: Token | str, *, job: str, world_size: int, timeout: timedelta = DEFAULT_TIMEOUT
) -> int | None:
    """The newest complete, verified durable step of `job` for `world_size` ranks, or None."""
    path = f"/v1/checkpoints/{check_id('job', job)}/latest?world_size={int(world_size)}"
    try:
        return int(call_json(url, _token(token), "GET", path, timeout=timeout)["step"])
    except NotFoundError:
        return None


@dataclass(frozen=True, slots=True)
class PositionRecord:
    """A replica's data position committed with `step`."""

    step: int
    position: dict[str, int]


def put_position(
    url: str,
    token: Token | str,
    *,
    job: str,
    replica: str,
    step: int,
    position: Mapping[str, int],
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Records durably (fsync) that `replica` committed `step` at data `position`."""
    path = f"/v1/positions/{check_id('job', job)}/{check_id('replica', replica)}"
    body = {"step": check_step(step), "position": dict(position)}
    call_json(url, _token(token), "PUT", path, timeout=timeout, body=body)


def get_position(
    url: str,
    token: Token | str,
    *,
    job: str,
    replica: str,
    at_step: int | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> PositionRecord | None:
    """The record with the greatest step ≤ `at_step` (the newest when None), or None if none."""
    path = f"/v1/positions/{check_id('job', job)}/{check_id('replica', replica)}"
    if at_step is not None:
        path += f"?at_step={check_step(at_step)}"
    try:
        raw = call_json(url, _token(token), "GET", path, timeout=timeout)
    except NotFoundError:
        return None
    return PositionRecord(int(raw["step"]), {str(k): int(v) for k, v in raw["position"].items()})
