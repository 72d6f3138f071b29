"""DataLoader workers started through forkserver end with their rank: a real rank-like process,
real workers, SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fthsdp.services.common.process_ref import ProcessRef, alive, process_start

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")


def _workers_of_killed_rank(*flags: str) -> list[ProcessRef]:
    """Starts the rank, reads its workers' pids, SIGKILLs the rank; returns the workers."""
    rank = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.loader_rank", *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    assert rank.stdout is not None
    try:
        pids = json.loads(rank.stdout.readline())
        workers = [ProcessRef(pid, process_start(pid) or 0) for pid in pids]
        assert len(workers) == 2 and all(alive(w) for w in workers)
    finally:
        rank.kill()
        rank.wait(timeout=10)
        rank.stdout.close()
    return workers


def _ended(workers: list[ProcessRef], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(w) for w in workers):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _reap(workers: list[ProcessRef]) -> None:
    for worker in workers:
        if alive(worker):
            os.kill(worker.pid, signal.SIGKILL)


def test_workers_of_a_killed_rank_exit() -> None:
    workers = _workers_of_killed_rank("--watched")
    try:
        assert _ended(workers, 20.0), "the workers outlived their rank"
    finally:
        _reap(workers)


def test_without_the_watch_they_are_left_behind() -> None:
    """The control: what the watch is for (PyTorch's own watchdog watches the forkserver)."""
    workers = _workers_of_killed_rank()
    try:
        assert not _ended(workers, 3.0), "unwatched workers ended by themselves"
    finally:
        _reap(workers)
