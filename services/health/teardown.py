"""Killing a torn-down replica's processes on this host, by the PIDs its ranks registered.

A rank names its process in every heartbeat (`process_ref.ProcessRef`: its pid and that
process's start time). Before the agent signals a pid it reads both again, so
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

from fthsdp.services.common.process_ref import MAX_PID, ProcessRef, alive, owner, stopped

log = logging.getLogger(__name__)


def may_signal(ref: ProcessRef) -> bool:
    """Whether `ref` is a live process this agent may kill: still the process that registered,
    of this agent's user, and not the agent, its parent or init."""
    if not 1 < ref.pid < MAX_PID or ref.pid in (os.getpid(), os.getppid()):
        return False
    return alive(ref) and owner(ref.pid) == os.geteuid()


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
        signum = signal.SIGKILL if stopped(ref.pid) else signal.SIGTERM
        if _signal(ref, signum):
            signalled.append(ref)
    deadline = time.monotonic() + grace_s
    while any(alive(r) for r in signalled) and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    for ref in signalled:
        if alive(ref) and _signal(ref, signal.SIGKILL):
            log.warning("process %d outlived SIGTERM by %.1f s: SIGKILL", ref.pid, grace_s)
    return [r.pid for r in signalled]
