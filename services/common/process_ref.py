"""Naming a process so that a reused pid does not match: its pid plus its start time (clock ticks
since boot, `/proc/<pid>/stat` field 22). Linux only; elsewhere the start is 0 (unknown), and a
process named that way is never taken for alive by `alive`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

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


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger): it cannot act on a signal."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("T", "t")


def owner(pid: int) -> int | None:
    """The uid owning process `pid`; None if it is gone."""
    try:
        return (_PROC / str(pid)).stat().st_uid
    except OSError:
        return None


def alive(ref: ProcessRef) -> bool:
    """Still the registered process, and not a zombie waiting for its parent to reap it."""
    fields = _stat_fields(ref.pid)
    if ref.start == 0 or fields is None or len(fields) <= 19:
        return False
    return int(fields[19]) == ref.start and fields[0] not in ("Z", "X")
