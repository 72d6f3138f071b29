"""Killing a torn-down replica's processes on this host, by the PIDs its ranks registered.

A rank names its process in every heartbeat: its pid and that process's start time (clock ticks
since boot, `/proc/<pid>/stat` field 22). Before the agent signals a pid it reads both again, so
a pid that was reused by another program since is never touched. It also signals only processes
of its own user, never itself, its parent or pid 1. The registration comes over the agent's
token-authenticated ingest, so only a holder of the job's token can name a process here.

The kill is SIGTERM, then SIGKILL after a grace for whatever still lives; a stopped process
(SIGSTOP, a debugger) cannot act on SIGTERM, so it gets SIGKILL at once."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_PID = 1 << 22
"""Linux's PID_MAX_LIMIT: no pid is larger."""
_PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcessRef:
    """One process, named so that a reused pid does not match."""

    pid: int
    start: int
    """Start time in clock ticks since boot (0: unknown, and then never signalled)."""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces), or None."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    _, sep, rest = text.rpartition(")")
    return rest.split() if sep else None


def process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot; None if it is gone (or this
    is not Linux)."""
    fields = _stat_fields(pid)
    # After the name: state is field 3 of stat, starttime field 22, so index 0 and 19 here.
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def this_process() -> ProcessRef:
    """The calling process, as a rank registers it (start 0 where /proc is not there)."""
    pid = os.getpid()
    return ProcessRef(pid, process_start(pid) or 0)


def _stopped(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("T", "t")


def _owner(pid: int) -> int | None:
    try:
        return (_PROC / str(pid)).stat().st_uid
    except OSError:
        return None


def _alive(ref: ProcessRef) -> bool:
    """Still the registered process, and not a zombie waiting for its parent to reap it."""
    fields = _stat_fields(ref.pid)
    if ref.start == 0 or fields is None or len(fields) <= 19:
        return False
    return int(fields[19]) == ref.start and fields[0] not in ("Z", "X")


def may_signal(ref: ProcessRef) -> bool:
    """Whether `ref` is a live process this agent may kill: still the process that registered,
    of this agent's user, and not the agent, its parent or init."""
    if not 1 < ref.pid < MAX_PID or ref.pid in (os.getpid(), os.getppid()):
        return False
    return _alive(ref) and _owner(ref.pid) == os.geteuid()


def _signal(ref: ProcessRef, signum: signal.Signals) -> bool:
    """Sends `signum` if `ref` still names the registered process; whether it was sent."""
    if not may_signal(ref):
        return False
    try:
        os.kill(ref.pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


async def kill(refs: list[ProcessRef], grace_s: float, *, poll_s: float = 0.05) -> list[int]:
    """SIGTERM to each of `refs` (SIGKILL to a stopped one), SIGKILL to those alive after
    `grace_s`; returns the pids that were signalled (the refused and the gone are skipped)."""
    signalled = []
    for ref in refs:
        signum = signal.SIGKILL if _stopped(ref.pid) else signal.SIGTERM
        if _signal(ref, signum):
            signalled.append(ref)
    deadline = time.monotonic() + grace_s
    while any(_alive(r) for r in signalled) and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    for ref in signalled:
        if _alive(ref) and _signal(ref, signal.SIGKILL):
            log.warning("process %d outlived SIGTERM by %.1f s: SIGKILL", ref.pid, grace_s)
    return [r.pid for r in signalled]
