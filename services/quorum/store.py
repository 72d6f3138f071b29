"""What the quorum service keeps beyond one process: incarnations, membership, quorum epochs.

`QuorumStore` is the seam for the durable (Redis) adapter of a later issue. The service keeps the
authoritative copy in memory while it runs and writes through to the store; it reads the store
only at start. Liveness (heartbeats) is never stored: after a restart every restored member gets
a fresh heartbeat timeout to show up.

Contract every adapter must keep (the Redis one with a script / WATCH, so a standby taking over
through a lease cannot regress it):
* `next_incarnation` is strictly increasing per replica id, forever;
* `save_quorum` rejects a quorum id lower than the stored one (I3: epochs never go back);
* `put_member` / `remove_member` are conditional on the incarnation, so a late write about an old
  incarnation never overwrites or deletes a newer one."""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from fthsdp.services.quorum.core import QuorumRecord, Registration


class QuorumStore(Protocol):
    """Durable state of the quorum service."""

    async def next_incarnation(self, replica_id: str) -> int:
        """A new incarnation for `replica_id`, greater than every earlier one."""
        ...

    async def put_member(self, registration: Registration) -> None:
        """Records a member, unless a newer incarnation of it is already recorded."""
        ...

    async def remove_member(self, replica_id: str, incarnation: int) -> None:
        """Forgets a member, only if the recorded incarnation is `incarnation`."""
        ...

    async def members(self) -> list[Registration]:
        """Every recorded member."""
        ...

    async def save_quorum(self, record: QuorumRecord) -> None:
        """Records a formed quorum; ValueError if its id is lower than the last saved one."""
        ...

    async def last_quorum(self) -> QuorumRecord | None:
        """The last saved quorum, if any."""
        ...

    async def epoch_floor(self) -> int:
        """A quorum id that every id this service issues must exceed (0: no floor beyond the
        last saved quorum)."""
        ...

    async def history(self, limit: int) -> list[QuorumRecord]:
        """Up to `limit` most recent quorums, oldest first."""
        ...


def clock_epoch_floor() -> int:
    """Milliseconds since the Unix epoch: the epoch floor of a fresh in-memory store.

    A restarted in-memory service forgets its last quorum id; starting above the wall clock in
    milliseconds keeps ids growing across restarts (I3) as long as the previous life issued fewer
    than one id per millisecond and the clock did not step back. The Redis store persists the
    id instead and needs no floor."""
    return time.time_ns() // 1_000_000


class InMemoryStore:
    """The embedded default: everything in this process (a restart forgets it)."""

    def __init__(self, *, history_size: int = 128, epoch_floor: int = 0) -> None:
        self._epoch_floor = epoch_floor
        self._incarnations: dict[str, int] = {}
        self._members: dict[str, Registration] = {}
        self._history: deque[QuorumRecord] = deque(maxlen=history_size)

    async def next_incarnation(self, replica_id: str) -> int:
        value = self._incarnations.get(replica_id, 0) + 1
        self._incarnations[replica_id] = value
        return value

    async def put_member(self, registration: Registration) -> None:
        current = self._members.get(registration.replica_id)
        if current is None or current.incarnation <= registration.incarnation:
            self._members[registration.replica_id] = registration

    async def remove_member(self, replica_id: str, incarnation: int) -> None:
        current = self._members.get(replica_id)
        if current is not None and current.incarnation == incarnation:
            del self._members[replica_id]

    async def members(self) -> list[Registration]:
        return list(self._members.values())

    async def save_quorum(self, record: QuorumRecord) -> None:
        if self._history and record.quorum_id < self._history[-1].quorum_id:
            raise ValueError(
                f"quorum id would go back from {self._history[-1].quorum_id} to {record.quorum_id}"
            )
        self._history.append(record)

    async def last_quorum(self) -> QuorumRecord | None:
        return self._history[-1] if self._history else None

    async def epoch_floor(self) -> int:
        return self._epoch_floor

    async def history(self, limit: int) -> list[QuorumRecord]:
        items = list(self._history)
        return items[-limit:] if limit > 0 else items
