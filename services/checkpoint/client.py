"""What a training process uses of the checkpoint service: publish, fetch, durable, positions.

All of it talks to a sidecar over HTTP; nothing here starts a server. Callers see typed errors from
`client_errors` (and TimeoutError), never HTTP types. Every call has a timeout and retries transport
errors and 503s with exponential backoff + jitter inside it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from fthsdp.services.checkpoint.client_errors import CheckpointError, NotFoundError
from fthsdp.services.checkpoint.client_fetch import (
    FetchedSnapshot,
    Source,
    SourceStats,
    fetch_checkpoint,
    fetch_snapshot,
    restore_latest,
)
from fthsdp.services.checkpoint.client_http import call_json
from fthsdp.services.checkpoint.client_manifest import check_id, check_rank, check_step
from fthsdp.services.checkpoint.client_publish import SnapshotPublisher
from fthsdp.services.common.backoff import Backoff, sleep_before_retry
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
