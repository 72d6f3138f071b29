"""This rank's side of state transfer: snapshots for peers, catch-up fetches, durable checkpoints.

Everything goes through the host's checkpoint sidecar (`services.checkpoint.client`): publishing
is one copy into its shared memory; serving, checksumming and durable writes happen in the
sidecar's process, so a healthy source never stalls on a recovering peer (I4)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch

from fthsdp.services.checkpoint.client import (
    SnapshotPublisher,
    latest_checkpoint,
    put_position,
    request_durable,
)
from fthsdp.services.checkpoint.client_errors import CheckpointError, ConflictError, NotFoundError
from fthsdp.services.checkpoint.client_fetch import Source, fetch_checkpoint, fetch_snapshot
from fthsdp.services.common.backoff import Backoff
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.data import DataPositions
from fthsdp.worker.plan import Source as PlanSource

log = logging.getLogger(__name__)

State = tuple[dict[str, torch.Tensor], dict[str, str | int]]


class StateFetchError(RuntimeError):
    """Catch-up could not get a verified state in time; the step's vote is no."""


class PeerState:
    """State transfer for one rank of one replica."""

    def __init__(self, *, config: ManagerConfig, rank: int, world_size: int) -> None:
        self._config = config
        self._rank = rank
        self._world_size = world_size
        self._publisher = SnapshotPublisher(
            config.checkpoint_url,
            config.token,
            job=config.job_id,
            replica_id=config.replica_id,
            rank=rank,
            shm_dir=config.shm_dir,
        )
        self._published: int | None = None
        forgotten = self._publisher.forget_earlier()
        if forgotten:
            log.info("dropped %d snapshot(s) of an earlier process of this rank", forgotten)

    def publish(
        self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, str | int]
    ) -> None:
        """Publishes the state as of the start of `step` (once per step)."""
        if self._published == step:
            return
        try:
            self._publisher.publish(step, tensors, meta)
        except ConflictError:
            # An earlier attempt of this process registered this step and its answer was lost:
            # the same bytes (earlier processes' snapshots were dropped at start).
            pass
        except (CheckpointError, OSError) as exc:
            # Serving is best effort: the recovering peer's fetch fails and it retries on the
            # next quorum, while this healthy replica trains on (I4). OSError: the sidecar did
            # not answer in time, or the host's shared memory is full (ENOSPC).
            log.warning("snapshot of step %d not published: %s", step, exc)
            return
        self._published = step

    def fetch_peer(
        self,
        sources: Sequence[PlanSource],
        step: int,
        *,
        cancelled: threading.Event | None = None,
        sources_in: threading.Event | None = None,
    ) -> State:
        """Fetches the healthy replicas' state of `step`, striped over `sources`.

        The sources publish when they see the same quorum, so a snapshot that is not there yet
        is waited for (with backoff) until the fetch deadline, until `cancelled` is set, or, once
        `sources_in` is set (every source entered the step's exchange, after its publish), until
        one more look finds it missing: a publish that failed is not waited out."""
        cancelled = cancelled or threading.Event()
        sources_in = sources_in or threading.Event()
        if not sources:
            raise StateFetchError("no healthy source assigned")
        deadline = time.monotonic() + self._config.fetch_timeout.total_seconds()
        delays = Backoff(initial=timedelta(milliseconds=10), maximum=timedelta(milliseconds=200))
        waits = delays.delays()
        targets = [Source(url=s.url, replica_id=s.replica_id) for s in sources]
        while True:
            left = deadline - time.monotonic()
            if cancelled.is_set():
                raise StateFetchError(f"fetching step {step} was cancelled")
            final = sources_in.is_set()  # read before the look that may then be the last
            try:
                fetched = fetch_snapshot(
                    targets,
                    job=self._config.job_id,
                    rank=self._rank,
                    step=step,
                    token=self._config.token,
                    deadline=timedelta(seconds=max(left, 0.001)),
                )
                return fetched.tensors, fetched.meta
            except NotFoundError as exc:
                left = deadline - time.monotonic()
                if left <= 0 or final:
                    raise StateFetchError(f"step {step} was never published: {exc}") from exc
                cancelled.wait(min(next(waits), left))
            except (CheckpointError, TimeoutError) as exc:
                raise StateFetchError(f"fetching step {step} failed: {exc}") from exc

    def latest_durable_step(self) -> int | None:
        """The newest complete durable checkpoint of the job, if any."""
        return latest_checkpoint(
            self._config.checkpoint_url,
            self._config.token,
            job=self._config.job_id,
            world_size=self._world_size,
        )

    def fetch_durable(self, step: int) -> State:
        """This rank's part of durable checkpoint `step`."""
        fetched = fetch_checkpoint(
            self._config.checkpoint_url,
            self._config.token,
            job=self._config.job_id,
            step=step,
            rank=self._rank,
            deadline=self._config.fetch_timeout,
        )
        return fetched.tensors, fetched.meta

    def request_durable(self, step: int) -> None:
        """Has the sidecar persist the published snapshot of `step` (asynchronously)."""
        try:
            request_durable(
                self._config.checkpoint_url,
                self._config.token,
                job=self._config.job_id,
                replica=self._config.replica_id,
                rank=self._rank,
                step=step,
                world_size=self._world_size,
            )
        except (CheckpointError, TimeoutError) as exc:
            # A missed durable checkpoint costs progress on a full restart, never correctness.
            log.warning("durable checkpoint of step %d not requested: %s", step, exc)

    def record_positions(self, step: int, positions: DataPositions) -> None:
        """Records the data positions committed with `step` (called off the training thread)."""
        try:
            put_position(
                self._config.checkpoint_url,
                self._config.token,
                job=self._config.job_id,
                replica=self._config.replica_id,
                step=step,
                position=positions.as_dict(),
            )
        except (CheckpointError, TimeoutError) as exc:
            log.warning("data position of step %d not recorded: %s", step, exc)
