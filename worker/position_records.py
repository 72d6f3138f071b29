"""The leader's trail of committed data positions with its checkpoint sidecar.

At most one record per interval, one at a time (each carries a copy of the table, so they arrive
in order and never go back), and a last one on a clean exit after the one before it. Exactly-once
data does not depend on them: the positions travel with the replicated state."""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import Executor, Future
from datetime import timedelta

from fthsdp.worker.data import DataPositions
from fthsdp.worker.peer_state import PeerState

_LAST_WAIT_S = 5.0
"""On close, how long the last record waits for the one before it."""


class PositionRecords:
    """Sends the committed positions off the training thread (see the module doc)."""

    def __init__(self, peer_state: PeerState, executor: Executor, interval: timedelta) -> None:
        self._peer_state = peer_state
        self._executor = executor
        self._interval = interval.total_seconds()
        self._sent_at = -math.inf
        self._last: Future[None] | None = None

    def committed(self, step: int, positions: DataPositions) -> None:
        """After a commit: records the table if the interval passed and the previous record
        arrived (a record still on its way is caught up by the next interval)."""
        now = time.monotonic()
        if now - self._sent_at < self._interval:
            return
        if self._last is not None and not self._last.done():
            return
        self._sent_at = now
        self._last = self._executor.submit(
            self._peer_state.record_positions, step, positions.copy()
        )

    def close(self, step: int, positions: DataPositions) -> None:
        """On a clean exit: the final positions, after the record before them."""
        if step == 0:
            return
        if self._last is not None:
            with contextlib.suppress(Exception):
                self._last.result(timeout=_LAST_WAIT_S)
        self._peer_state.record_positions(step, positions)
