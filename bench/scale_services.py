"""The real services of `bench.scale`, each in its own spawned process so that its CPU time and
memory are its own (`/proc/<pid>`): the quorum service (`QuorumServer`, in-memory store) and the
central health service (`HealthProcess` in central mode, no HTTP). Both bind port 0 on loopback
and check the bearer token like in production; this module adds only observation:

* the quorum process answers `timings` with the coordinator's server-side round timings;
* both answer `gc` with the time they spent in Python's garbage collector (`GcPauses`);
* the central process's `HealthCore` is a subclass whose `evaluate` records its own duration and
  what it found (for the RCA time), answered to `evaluations`; `hang_timeout` changes that
  detector setting at run time (as the HTTP settings API does); `reports` counts the Report
  calls the service completed.

`--profile DIR` runs either under cProfile and dumps `quorum.prof` / `central.prof` on stop."""

from __future__ import annotations

import asyncio
import cProfile
import gc
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fthsdp.services.common import gc_tuning, logs
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.core import HealthCore
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.process import HealthProcess
from fthsdp.services.health.telemetry import Incident
from fthsdp.services.quorum import core as quorum_core
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.server import QuorumServer

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumSettings:
    """How the quorum service process runs."""

    heartbeat_timeout_s: float
    lift_world_size_cap: int | None = None
    """Raise `core.MAX_WORLD_SIZE` to this in the service process (None: today's cap)."""
    profile: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class CentralSettings:
    """How the central health process runs."""

    hang_timeout_s: float
    heartbeat_timeout_s: float
    """The central fail-stop detector's timeout (the agents find fail-stops first)."""
    quorum: str
    """The quorum service: the central service evicts what an agent could not (a failed report)
    and what it finds itself (a hang)."""
    profile: str | None = None


class GcPauses:
    """Time the process spends in Python's cyclic garbage collector, by generation (observed
    with `gc.callbacks`; at ~100K open streams a full collection walks millions of objects)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self.longest = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.seconds[generation] += pause
        self.count[generation] += 1
        self.longest = max(self.longest, pause)

    def snapshot(self) -> dict[str, Any]:
        return {"seconds": list(self.seconds), "count": list(self.count), "longest": self.longest}


def _profiled(path: str | None, run: Callable[[], None]) -> None:
    if path is None:
        run()
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
        profiler.dump_stats(path)


async def _commands(conn: Connection, handle: Callable[[str, Any], Any]) -> int:
    """Answers the orchestrator's (tag, command, argument) requests with (tag, answer) until
    `stop`; returns the stop's tag (its answer goes once the service has stopped)."""
    loop = asyncio.get_running_loop()
    while True:
        seq, command, argument = await loop.run_in_executor(None, conn.recv)
        if command == "stop":
            return int(seq)
        conn.send((seq, handle(command, argument)))


def serve_quorum(conn: Connection, token: str, settings: QuorumSettings) -> None:
    """Quorum service process: sends its address, answers `timings`, stops on `stop`."""
    logs.configure("ERROR")  # evictions are the point here; keep the table clean
    if settings.lift_world_size_cap is not None:
        quorum_core.MAX_WORLD_SIZE = max(quorum_core.MAX_WORLD_SIZE, settings.lift_world_size_cap)

    pauses = GcPauses()

    async def main() -> None:
        config = QuorumConfig(
            port=0,
            admin_port=None,
            heartbeat_timeout=timedelta(seconds=settings.heartbeat_timeout_s),
        )
        server = QuorumServer(config, token)
        await server.start()
        gc_tuning.settle()
        conn.send(server.address)

        def handle(command: str, since: Any) -> Any:
            if command == "timings":
                return [
                    (t.round, t.participants, t.seconds)
                    for t in server.round_timings()
                    if t.round > since
                ]
            if command == "gc":
                return pauses.snapshot()
            raise ValueError(f"unknown command {command!r}")

        stop.append(await _commands(conn, handle))
        await server.stop(timedelta(seconds=1))

    stop: list[int] = []
    _profiled(settings.profile, lambda: asyncio.run(main()))
    conn.send((stop[0], "stopped"))  # after the profile is written


@dataclass(slots=True)
class Evaluation:
    """One `HealthCore.evaluate` call in the central service."""

    at: float
    """Monotonic time it returned."""
    seconds: float
    incidents: list[dict[str, Any]] = field(default_factory=list)


class TimedCore(HealthCore):
    """HealthCore that records each evaluation's duration and incidents (observation only)."""

    __slots__ = ("evaluations",)

    def __init__(self, config: DetectorConfig) -> None:
        super().__init__(config)
        self.evaluations: list[Evaluation] = []

    def evaluate(self, now: float) -> list[Incident]:
        started = time.perf_counter()
        found = super().evaluate(now)
        seconds = time.perf_counter() - started
        if found or seconds > 0.05:  # keep the record list small: only what says something
            self.evaluations.append(
                Evaluation(
                    at=time.monotonic(),
                    seconds=seconds,
                    incidents=[
                        {"kind": i.kind.value, "replica_id": i.replica_id, "rank": i.rank}
                        for i in found
                    ],
                )
            )
        return found


def serve_central(conn: Connection, token: str, settings: CentralSettings) -> None:
    """Central health process: sends its address, answers `evaluations`, stops on `stop`."""
    logs.configure("ERROR")
    pauses = GcPauses()

    async def main() -> None:
        detectors = DetectorConfig(
            hang_timeout_s=settings.hang_timeout_s,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
        )
        config = HealthConfig(mode="central", port=0, http_port=None, quorum=(settings.quorum,))
        node = HealthProcess(config, token, detectors=detectors)
        assert node.engine is not None
        core = TimedCore(detectors)
        node.engine.core = core  # before start: nothing was ingested yet
        await node.start()
        gc_tuning.settle()
        conn.send(node.grpc_address)

        def handle(command: str, since: Any) -> Any:
            if command == "evaluations":
                return [(e.at, e.seconds, e.incidents) for e in core.evaluations[since:]]
            if command == "gc":
                return pauses.snapshot()
            if command == "hang_timeout":  # as the HTTP settings API would
                assert node.engine is not None
                node.engine.reconfigure(replace(node.engine.detectors, hang_timeout_s=since))
                return since
            if command == "reports":  # Report calls the service completed (whoever waited)
                labels = {"method": "Report", "code": "OK"}
                value = node.metrics.registry.get_sample_value(
                    "fthsdp_health_requests_total", labels
                )
                return int(value or 0)
            raise ValueError(f"unknown command {command!r}")

        stop.append(await _commands(conn, handle))
        await node.stop()

    stop: list[int] = []
    _profiled(settings.profile, lambda: asyncio.run(main()))
    conn.send((stop[0], "stopped"))  # after the profile is written


# ---- /proc ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcSample:
    """One process's CPU time and memory at a moment."""

    cpu_s: float
    """user + system CPU seconds since the process started."""
    rss_bytes: int
    hwm_bytes: int
    """Peak RSS so far (VmHWM)."""


def sample(pid: int) -> ProcSample | None:
    """The process's counters, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    memory = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            memory[key] = int(value.split()[0]) * 1024
    return ProcSample(
        cpu_s=(int(stat[11]) + int(stat[12])) / _CLK_TCK,
        rss_bytes=memory.get("VmRSS", 0),
        hwm_bytes=memory.get("VmHWM", 0),
    )


class Watchdog:
    """Samples the harness's processes every second; past `cap_bytes` of RSS in all, calls
    `on_cap` once (it kills them: a shared machine must not run out of memory)."""

    def __init__(self, pids: dict[str, int], cap_bytes: int, on_cap: Callable[[], None]) -> None:
        self.pids = dict(pids)
        self.cap_bytes = cap_bytes
        self.peak_total = 0
        self.peaks: dict[str, int] = dict.fromkeys(pids, 0)
        self.tripped: str | None = None
        self._on_cap = on_cap
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scale-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            total = 0
            for name, pid in self.pids.items():
                s = sample(pid)
                if s is not None:
                    self.peaks[name] = max(self.peaks[name], s.rss_bytes)
                    total += s.rss_bytes
            self.peak_total = max(self.peak_total, total)
            if total > self.cap_bytes and self.tripped is None:
                self.tripped = f"RSS of the harness reached {total / 2**30:.1f} GiB (cap)"
                self._on_cap()


def profile_path(directory: str | None, name: str) -> str | None:
    """Where a service's profile goes (None: not profiled)."""
    if directory is None:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    return str(Path(directory) / f"{name}.prof")
