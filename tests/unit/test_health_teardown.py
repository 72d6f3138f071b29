"""Killing registered processes: real child processes, real signals, pids checked against their
start times (so a reused pid is never signalled)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fthsdp.services.common.process_ref import ProcessRef, process_start, this_process
from fthsdp.services.health.teardown import kill, may_signal

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")

_SLEEPER = "import time\nwhile True: time.sleep(1)"
_STUBBORN = "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
_STUBBORN += "print('ready', flush=True)\nwhile True: time.sleep(1)"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()


def _start(children: list[subprocess.Popen[bytes]], code: str) -> ProcessRef:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    children.append(child)
    start = process_start(child.pid)
    assert start is not None
    return ProcessRef(child.pid, start)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_a_process_names_itself_by_pid_and_start_time() -> None:
    me = this_process()
    assert me.pid == os.getpid() and me.start == process_start(os.getpid()) and me.start > 0
    assert not may_signal(me), "an agent never signals itself"
    assert not may_signal(ProcessRef(1, process_start(1) or 1)), "nor init"


async def test_sigterm_ends_a_registered_process(children: list[subprocess.Popen[bytes]]) -> None:
    ref = _start(children, _SLEEPER)
    assert await kill([ref], grace_s=10.0) == [ref.pid]
    assert children[0].wait(timeout=10) == -signal.SIGTERM


async def test_a_process_that_ignores_sigterm_gets_sigkill_after_the_grace(
    children: list[subprocess.Popen[bytes]],
) -> None:
    ref = _start(children, _STUBBORN)
    assert children[0].stdout is not None
    assert children[0].stdout.readline() == b"ready\n"  # its SIGTERM handler is in place
    assert await kill([ref], grace_s=0.2) == [ref.pid]
    assert children[0].wait(timeout=10) == -signal.SIGKILL


async def test_a_stopped_process_gets_sigkill_at_once(
    children: list[subprocess.Popen[bytes]],
) -> None:
    ref = _start(children, _SLEEPER)
    os.kill(ref.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while _state(ref.pid) != "T":  # the kernel stops it a moment later
        assert time.monotonic() < deadline, "the child never stopped"
        time.sleep(0.01)
    # A grace far beyond the test's timeout: only SIGKILL up front ends it in time.
    assert await kill([ref], grace_s=3600.0) == [ref.pid]
    assert children[0].wait(timeout=10) == -signal.SIGKILL


async def test_a_pid_whose_start_time_differs_is_left_alone(
    children: list[subprocess.Popen[bytes]],
) -> None:
    ref = _start(children, _SLEEPER)
    reused = ProcessRef(ref.pid, ref.start + 1)  # as if the pid now named another program
    unknown = ProcessRef(ref.pid, 0)
    assert await kill([reused, unknown], grace_s=0.1) == []
    assert children[0].poll() is None
    assert await kill([ref], grace_s=10.0) == [ref.pid]  # the right name still works
    assert children[0].wait(timeout=10) == -signal.SIGTERM


async def test_a_gone_process_is_skipped(children: list[subprocess.Popen[bytes]]) -> None:
    ref = _start(children, _SLEEPER)
    children[0].kill()
    children[0].wait(timeout=10)
    assert process_start(ref.pid) is None
    assert await kill([ref], grace_s=0.1) == []
