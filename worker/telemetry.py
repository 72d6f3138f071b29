"""What one rank tells the health service about its steps, as the Manager sees them.

A thin layer over `services.health.client.TelemetryClient` (asynchronous, batched, never raises,
never blocks training beyond a queue put): per step its timing and workload (tokens N and
Σ seq_len², the fail-slow predictor's inputs), the cross-replica exchange as a collective record
(its whole passage, and an entry while it is still open at a flush: a rank that never leaves it
is what the hang detector looks for), and every `fingerprint_every_steps` a digest of the
replica's state for silent-corruption detection.
Without a health address every call is a no-op."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from fthsdp.services.common.tokens import Token
from fthsdp.services.health.client import InboundLink, TelemetryClient
from fthsdp.worker.ftar import FtarStats
from fthsdp.worker.step_account import StepCost


class StepTelemetry:
    """One rank's reporter (see the module doc)."""

    def __init__(
        self,
        address: str | None,
        token: str | Token,
        *,
        replica_id: str,
        rank: int,
        fingerprint_every_steps: int,
    ) -> None:
        self._client = (
            TelemetryClient(address, token, replica_id=replica_id, rank=rank) if address else None
        )
        self._rank = rank
        self._every = fingerprint_every_steps
        self._received = (0, 0.0)
        """The ring's inbound counters (bytes, busy seconds) at the last exchange's exit."""

    @property
    def enabled(self) -> bool:
        """Whether anything is sent."""
        return self._client is not None

    def exchange_entered(self, quorum_id: int, step: int) -> None:
        """This rank entered the cross-replica exchange of `step` on ring `quorum_id`."""
        if self._client is not None:
            group = f"ftar:{quorum_id}:{self._rank}"
            self._client.enter_collective(group, step, "allreduce", started_at=time.time())

    def exchange_left(self, ring: FtarStats, sender_replica: str | None) -> None:
        """The exchange entered last returned (successfully or not). With it goes what the
        ring received from `sender_replica` (its left neighbour) since the last exchange, and
        how long that link took: the health service names a replica behind slow links by it."""
        received = (ring.bytes_received, ring.receive_busy_s)
        before, self._received = self._received, received
        if self._client is None:
            return
        if received[0] < before[0]:  # a new ring object: its counters start from zero
            before = (0, 0.0)
        inbound = None
        if sender_replica is not None and received[0] > before[0]:
            inbound = InboundLink(
                sender_replica=sender_replica,
                bytes=received[0] - before[0],
                busy_s=max(0.0, received[1] - before[1]),
            )
        self._client.leave_collective(ended_at=time.time(), inbound=inbound)

    def committed(
        self, step: int, cost: StepCost, *, quorum_id: int, digest: Callable[[], str]
    ) -> None:
        """A committed step (wall times from `time.time()`): its timing, with the time spent
        waiting on others (not this replica's own speed: the fail-slow detector subtracts it),
        its workload, and on a fingerprint step the replica's state digest (`digest()`, called
        only then: it hashes the whole state)."""
        if self._client is None:
            return
        duration = max(0.0, time.time() - cost.started_at)
        self._client.step(
            step,
            started_at=cost.started_at,
            duration_s=duration,
            tokens=cost.tokens,
            sum_seq_len_sq=cost.sum_seq_len_sq,
            committed=True,
            exchange_wait_s=min(cost.waiting_s, duration),
        )
        if self._rank == 0 and self._every > 0 and step % self._every == 0:
            self._client.fingerprint(step, digest(), quorum_id=quorum_id)

    def close(self) -> None:
        """Flushes briefly and stops (a clean exit: no incident)."""
        if self._client is not None:
            self._client.close()

    def leave(self, reason: str) -> None:
        """Says this rank leaves on purpose (a teardown), within a short bound, and stops."""
        if self._client is not None:
            self._client.close(timedelta(milliseconds=200), reason=reason)
