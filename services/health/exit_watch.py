"""A local rank's death known when its process ends, not a heartbeat timeout later.

The node agent learns each local rank's process (pid and start time) from its heartbeats. On
Linux it opens a pidfd for it: the descriptor names that very process (a pid reused later cannot
match), and the event loop sees it readable once the process has exited. A crashed or killed rank
is then reported within milliseconds, where the heartbeat timeout (0.7 s by default) would have
run in full. A rank that leaves cleanly says so first, and is no longer watched by then.

Only processes this agent may signal are watched (`teardown.may_signal`: the agent's own user,
the pid still naming the registered process), at most `MAX_WATCHED` at once. Anything else (not
Linux, another pid namespace, another user) is left to the heartbeat timeout, as before."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from fthsdp.services.common.process_ref import ProcessRef, process_start
from fthsdp.services.health.teardown import may_signal
from fthsdp.services.health.telemetry import RankId

__all__ = ["MAX_WATCHED", "ExitWatch"]

log = logging.getLogger(__name__)

MAX_WATCHED = 1024
"""Descriptors one agent holds at most (a host runs a few ranks; the bound is against a client
that names many)."""

_PIDFD_OPEN: Callable[[int], int] | None = getattr(os, "pidfd_open", None)


class ExitWatch:
    """The pidfds of the local ranks' processes, on the running event loop. `on_exit(rank, ref)`
    runs on the loop when a watched process has exited. Not thread-safe: loop thread only."""

    def __init__(self, on_exit: Callable[[RankId, ProcessRef], None]) -> None:
        self._on_exit = on_exit
        self._watched: dict[RankId, tuple[ProcessRef, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, rank: RankId, ref: ProcessRef) -> bool:
        """Watches `ref` as `rank`'s process from now on (an earlier one of the rank's is
        dropped); False where it cannot be (then the heartbeat timeout stays the only signal)."""
        current = self._watched.get(rank)
        if current is not None and current[0] == ref:
            return True
        self.forget(rank)
        if _PIDFD_OPEN is None or len(self._watched) >= MAX_WATCHED or not may_signal(ref):
            return False
        try:
            fd = _PIDFD_OPEN(ref.pid)
        except OSError:  # gone meanwhile (its silence will tell), or not visible from here
            return False
        # Opened after the check above: the pid must still name the registered process.
        if process_start(ref.pid) != ref.start:
            os.close(fd)
            return False
        loop = self._loop = self._loop or asyncio.get_running_loop()
        loop.add_reader(fd, self._exited, rank, fd)
        self._watched[rank] = (ref, fd)
        return True

    def forget(self, rank: RankId) -> None:
        """Stops watching `rank` (it left, or its replica is torn down here)."""
        entry = self._watched.pop(rank, None)
        if entry is not None:
            self._release(entry[1])

    def close(self) -> None:
        """Stops watching everything."""
        for _, fd in self._watched.values():
            self._release(fd)
        self._watched.clear()

    def _exited(self, rank: RankId, fd: int) -> None:
        entry = self._watched.get(rank)
        if entry is None or entry[1] != fd:
            return  # forgotten or replaced in the same loop turn
        self.forget(rank)
        try:
            self._on_exit(rank, entry[0])
        except Exception:
            log.exception("handling the exit of %s failed", rank)

    def _release(self, fd: int) -> None:
        if self._loop is not None:
            self._loop.remove_reader(fd)
        os.close(fd)
