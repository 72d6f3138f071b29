"""`fthsdp up` as a process for the end-to-end tests: its env file, its services, its stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
    """Polls `probe` until it returns something truthy; fails with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


class Up:
    """One `fthsdp up` process and what it publishes in its run dir."""

    def __init__(self, run_dir: Path, *extra: str) -> None:
        self.run_dir = run_dir
        self.log = run_dir.parent / "up.out"
        argv = [sys.executable, "-m", "fthsdp.deploy.cli", "up", "--run-dir", str(run_dir)]
        argv += ["--stop-grace-s", "10", *extra]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def env(self) -> dict[str, str]:
        path = self.run_dir / "fthsdp.env"

        def read() -> dict[str, str] | None:
            assert self.proc.poll() is None, f"fthsdp up exited:\n{self.output()}"
            if not path.exists():
                return None
            lines = path.read_text().splitlines()
            return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))

        return wait_for("the env file", read, timeout=90)

    def services(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((self.run_dir / "services.json").read_text())
        return dict(state["services"])

    def job(self) -> dict[str, list[int]]:
        """Replica id -> the pids of its running ranks, when `up` runs the job."""
        state: dict[str, Any] = json.loads((self.run_dir / "services.json").read_text())
        return dict(state["job"])

    def pid(self, name: str) -> int:
        return int(self.services()[name]["pid"])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)
