"""End-to-end runs of the demo job: real processes, real sockets, SIGKILL."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fthsdp.deploy.demo.run import DemoConfig, run_demo
from tests.e2e.up_support import Up

DemoRunner = Callable[..., dict[str, Any]]


@pytest.fixture
def demo(tmp_path: Path) -> DemoRunner:
    """Runs the demo with small, fast settings; keyword arguments override DemoConfig fields."""

    def run(**overrides: Any) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "replicas": 3,
            "ranks": 1,
            "duration": timedelta(seconds=20),
            "kill_every": None,
            "run_dir": tmp_path / "run",
            "durable_every_steps": 10,
            "live": False,
            "settle_timeout": timedelta(seconds=60),
        }
        settings.update(overrides)
        return run_demo(DemoConfig(**settings))

    return run


def commits_by_replica(report: dict[str, Any]) -> dict[str, list[int]]:
    """Steps each replica committed, from the report's per-replica samples."""
    return {
        replica: sorted({s["step"] for s in entry["samples"]})
        for replica, entry in report["replicas"].items()
    }


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    """Starts `fthsdp up` processes (extra flags as arguments); kills what is left after."""
    started: list[Up] = []

    def start(*extra: str) -> Up:
        up = Up(tmp_path / "run", *extra)
        started.append(up)
        return up

    yield start
    for up in started:
        if up.proc.poll() is None:
            try:
                up.stop()  # SIGTERM: the stack removes its shared-memory directory
            except subprocess.TimeoutExpired:
                up.proc.kill()
                up.proc.wait()
