"""Runs the demo's replicas as local processes, restarts the ones that die, and injects failures.

Like a per-host agent (torchrun's, a node agent): it sees a rank process end at once, kills the
rest of that replica (the replica is the unit of failure), tells the quorum service so survivors
stop waiting for it, and starts the replica again as a new incarnation."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fthsdp.deploy.demo.events import (
    CommitEvent,
    EventLog,
    ExitEvent,
    InjectEvent,
    JsonlTail,
    LaunchEvent,
    RestartEvent,
    RollbackEvent,
    SparesEvent,
)
from fthsdp.deploy.netns_demo import NETNS_KILL_MODES
from fthsdp.deploy.processes import free_port, kill_all, terminate_all
from fthsdp.deploy.spares import SparePool
from fthsdp.worker.spare import Identity

log = logging.getLogger(__name__)

RESTART_POLICIES = ("replica", "job")
"""replica: only the failed replica restarts (FT-HSDP); job: every replica restarts from the last
durable checkpoint on any failure (the synchronous-training baseline)."""

KILL_MODES = (
    "process",
    "replica",
    "hang",
    "slow",
    "quorum",
    "store",
    "store-replica",
    *NETNS_KILL_MODES,
)
"""process: SIGKILL one rank; replica: SIGKILL a whole replica; hang: SIGSTOP one rank (a hung
GPU or NCCL call as the host sees it); slow: throttle every rank of a replica for
`SLOW_PERIOD_S` (a fail-slow machine: see `Throttle`), then let it run normally; quorum: restart
the (in-memory) quorum service; store: SIGKILL the redis-server (with Redis), which stays down
for a while and then comes back; store-replica: that, and a whole replica SIGKILLed while the
store is down. blackhole, leader-blackhole, leader-redis-cut, health-cut, flap, slow-link:
network faults with `--hosts netns` (see `deploy.netns_demo`)."""

REFILL_HOLD_S = 10.0
"""Longest a takeover holds back the spare pool's refill. A spare warming up takes a core for
seconds; started as the taken spares join, it would slow their catch-up on a small host, so the
refill waits until the replica commits again (or this long, if it never does)."""

AWAIT_REPLICAS_S = 30.0
"""How long a replica's first launch waits for the job's other replicas to register before its
first step (`deploy.demo.train --await-replicas-s`)."""

SLOW_PERIOD_S = 12.0
"""How long `slow` throttles a replica: past the fail-slow detector's 5 s settle after a
membership change plus its >= 5 steps spanning >= 2 s, with room for a loaded host."""
SLOW_CYCLE_S = 0.05
"""One stop/continue cycle of the throttle."""
SLOW_STOPPED_FRACTION = 0.6
"""The share of each cycle the throttled processes are stopped: the replica runs ~2.5x slower.
A stop lasts 30 ms, far below the 200 ms heartbeat period and the 700 ms fail-stop timeout, so
no beat lapses: the replica is slow, never dead."""


class Throttle:
    """Duty-cycles SIGSTOP/SIGCONT over a replica's processes from a thread, for a period.

    No cgroups: the processes get stopped for `stopped_fraction` of every `cycle_s`. Every stop
    is followed by a SIGCONT: at each cycle, when the period ends, and on `stop` (a teardown of
    the replica, the demo's shutdown), which joins the thread and continues them once more. A
    process that ended meanwhile is skipped (a signal to a reaped process is a no-op). Only a
    launcher that is itself SIGKILLed mid-stop leaves its ranks stopped (`kill -CONT` them)."""

    def __init__(
        self,
        procs: list[subprocess.Popen[bytes]],
        *,
        period_s: float = SLOW_PERIOD_S,
        cycle_s: float = SLOW_CYCLE_S,
        stopped_fraction: float = SLOW_STOPPED_FRACTION,
    ) -> None:
        if not (period_s > 0 and cycle_s > 0 and 0 < stopped_fraction < 1):
            raise ValueError("period_s and cycle_s must be positive, stopped_fraction in (0, 1)")
        self._procs = list(procs)
        self._period_s = period_s
        self._stopped_s = cycle_s * stopped_fraction
        self._running_s = cycle_s - self._stopped_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-throttle", daemon=True)

    @property
    def active(self) -> bool:
        """Whether the period is still going."""
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the throttle now (idempotent); every process is continued when it returns."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self._signal(signal.SIGCONT)

    def _run(self) -> None:
        end = time.monotonic() + self._period_s
        try:
            while time.monotonic() < end:
                self._signal(signal.SIGSTOP)
                stopped = self._done.wait(self._stopped_s)
                self._signal(signal.SIGCONT)
                if stopped or self._done.wait(self._running_s):
                    return
        finally:
            self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):  # ended since the last look
                proc.send_signal(signum)


@dataclass(slots=True)
class Replica:
    """One replica's rank processes, as the supervisor sees them."""

    replica_id: str
    index: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    restart_at: float | None = None
    """When a dead replica is started again (monotonic time); None while it runs."""
    hung: bool = False
    throttle: Throttle | None = None
    """The `slow` injection's throttle, while one is or was running on this incarnation."""
    starts: int = 0
    ended: set[int] = field(default_factory=set)
    """Ranks whose clean exit at the end was logged already (they wait for the others)."""

    @property
    def running(self) -> bool:
        return bool(self.procs)

    @property
    def throttled(self) -> bool:
        return self.throttle is not None and self.throttle.active

    def unthrottle(self) -> None:
        """Ends a throttle (its processes continue); a no-op without one."""
        if self.throttle is not None:
            self.throttle.stop()
            self.throttle = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaCommand:
    """How to start the ranks of a replica."""

    run_dir: Path
    """Where logs go."""
    world_size: int
    """Ranks per replica."""
    total_replicas: int
    """Replicas in the job."""
    quorum_address: str
    """The quorum service."""
    checkpoint_urls: Mapping[str, str]
    """Replica id → the checkpoint sidecar of the host it runs on."""
    shm_dirs: Mapping[str, str]
    """Replica id → that sidecar's shared-memory directory."""
    token_file: Path
    """Bearer token file handed to every rank."""
    health_agents: Mapping[str, str] = field(default_factory=dict)
    """Replica id → the health node agent of its host (none: no telemetry)."""
    prefixes: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Replica id → the argv prefix that runs a process on its host (none: right here)."""
    ftar_hosts: Mapping[str, str] = field(default_factory=dict)
    """Replica id → the address its ranks' FTAR listeners bind and advertise (none: the
    rank's default, loopback)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every rank (fault plans)."""
    extra_args: tuple[str, ...] = ()
    """Further flags for `deploy.demo.train`."""

    def argv(self, replica: Replica, rank: int, init_port: int) -> list[str]:
        """The command line of a fresh rank process, on its replica's host; at the job's first
        launch its leader waits for every replica before the first step (a restart never)."""
        prefix = self.prefixes.get(replica.replica_id, ())
        start = ["--await-replicas-s", str(AWAIT_REPLICAS_S)] if replica.starts == 1 else []
        return [*prefix, *self.common_argv(), *self.identity(replica, rank, init_port), *start]

    def spare_argv(self) -> list[str]:
        """A warm spare: everything but its identity, which it reads from its identity pipe once
        taken (`fthsdp.worker.spare`)."""
        return [*self.common_argv(), "--spare"]

    def common_argv(self) -> list[str]:
        """What every rank of the job shares."""
        return [
            sys.executable,
            "-m",
            "fthsdp.deploy.demo.train",
            "--run-dir",
            str(self.run_dir),
            "--total-replicas",
            str(self.total_replicas),
            "--world-size",
            str(self.world_size),
            "--quorum",
            self.quorum_address,
            "--token-file",
            str(self.token_file),
            "--stop-file",
            str(self.run_dir / "stop.json"),
            *self.extra_args,
        ]

    def identity(self, replica: Replica, rank: int, init_port: int) -> list[str]:
        """What makes a process rank `rank` of `replica` (a spare gets it when it takes over)."""
        return [
            "--replica-id",
            replica.replica_id,
            "--replica-index",
            str(replica.index),
            "--rank",
            str(rank),
            "--init-method",
            f"tcp://127.0.0.1:{init_port}",
            "--checkpoint-url",
            self.checkpoint_urls[replica.replica_id],
            "--shm-dir",
            self.shm_dirs[replica.replica_id],
            *self._health_args(replica),
            *self._ftar_args(replica),
        ]

    def _health_args(self, replica: Replica) -> list[str]:
        agent = self.health_agents.get(replica.replica_id)
        return ["--health", agent] if agent else []

    def _ftar_args(self, replica: Replica) -> list[str]:
        host = self.ftar_hosts.get(replica.replica_id)
        return ["--ftar-host", host] if host else []


class ReplicaSupervisor:
    """Starts, watches, restarts and (on purpose) breaks replicas."""

    def __init__(
        self,
        command: ReplicaCommand,
        events: EventLog,
        *,
        on_failure: Callable[[str, str], None],
        restart_delay: float = 0.5,
        restart_policy: str = "replica",
        spares: int = 0,
    ) -> None:
        if restart_policy not in RESTART_POLICIES:
            raise ValueError(f"restart_policy must be one of {RESTART_POLICIES}")
        self._policy = restart_policy
        self.command = command
        self.events = events
        self._on_failure = on_failure
        self._restart_delay = restart_delay
        self.replicas = [
            Replica(replica_id=f"r{i}", index=i) for i in range(command.total_replicas)
        ]
        self._logs = command.run_dir / "logs"
        self._logs.mkdir(parents=True, exist_ok=True)
        self._env = {**os.environ, **command.env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.spares = SparePool(spares, command.spare_argv(), self._env, self._logs)
        """Warm spare rank processes (empty with `spares=0`); `poll` keeps it full."""
        self._spares_shown = -1
        self._takeovers: dict[str, tuple[JsonlTail, float]] = {}
        """Replicas that took spares and have not committed since: their log from the takeover
        on, and when their hold on the refill ends anyway (`REFILL_HOLD_S`)."""
        self.stopping = False

    def by_id(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.replica_id == replica_id), None)

    def start(self, replica: Replica) -> None:
        """Launches a replica; a restart takes warm spares when enough are ready."""
        port = free_port()
        replica.starts += 1
        taken = self.spares.take(self.command.world_size) if replica.starts > 1 else None
        if taken is not None:
            log_path = self.command.run_dir / "replicas" / f"{replica.replica_id}.jsonl"
            tail = JsonlTail(log_path, strict=False)
            tail.skip_to_end()
            self._takeovers[replica.replica_id] = (tail, time.monotonic() + REFILL_HOLD_S)
            log_file = str(self._logs / f"{replica.replica_id}.log")
            for rank, spare in enumerate(taken):
                argv = self.command.identity(replica, rank, port)
                spare.hand_over(Identity(argv=tuple(argv), log_file=log_file))
            replica.procs = [spare.proc for spare in taken]
        else:
            out = (self._logs / f"{replica.replica_id}.log").open("ab")
            replica.procs = [
                subprocess.Popen(
                    self.command.argv(replica, rank, port), env=self._env, stdout=out, stderr=out
                )
                for rank in range(self.command.world_size)
            ]
            out.close()
        replica.restart_at = None
        replica.hung = False
        if replica.starts > 1:
            self.events.write(RestartEvent(replica=replica.replica_id, spare=taken is not None))
        else:
            self.events.write(LaunchEvent(replica=replica.replica_id))

    def start_all(self) -> None:
        for replica in self.replicas:
            self.start(replica)

    def fail(self, replica: Replica, reason: str) -> None:
        """Kills what is left of a replica (of every replica under the job policy), reports it,
        and schedules the restart."""
        victims = [replica]
        if self._policy == "job":
            victims += [r for r in self.replicas if r is not replica and r.running]
            self.events.write(RollbackEvent(replica=replica.replica_id))
        for victim in victims:
            self._take_down(victim, reason)

    def _take_down(self, replica: Replica, reason: str) -> None:
        replica.unthrottle()
        kill_all(replica.procs)
        replica.procs = []
        self._on_failure(replica.replica_id, reason)
        if not self.stopping:
            # Warm spares take over at once; fresh processes after the delay.
            ready = self.spares.warm >= self.command.world_size
            replica.restart_at = time.monotonic() + (0.0 if ready else self._restart_delay)

    def poll(self) -> None:
        """Reaps ended ranks; a dead rank takes its whole replica down; restarts when due;
        refills the spare pool."""
        now = time.monotonic()
        if not self.stopping and self.spares.size:
            if not self._refill_held(now):
                self.spares.refill()
            warm = self.spares.warm
            if warm != self._spares_shown:
                self._spares_shown = warm
                self.events.write(SparesEvent(warm=warm))
        for replica in self.replicas:
            for rank, proc in enumerate(replica.procs):
                code = proc.poll()
                if code is None or rank in replica.ended:
                    continue
                self.events.write(ExitEvent(replica=replica.replica_id, rank=rank, code=code))
                if code == 0 and self.stopping:
                    replica.ended.add(rank)
                    continue
                self.fail(replica, f"rank {rank} exited with {code}")
                break
            if self.stopping and replica.procs and all(p.poll() is not None for p in replica.procs):
                replica.procs = []
            if replica.restart_at is not None and now >= replica.restart_at and not self.stopping:
                self.start(replica)

    def _refill_held(self, now: float) -> bool:
        """Whether a takeover still holds the refill back: its replica has not committed since
        (nor has `REFILL_HOLD_S` passed)."""
        for replica_id, (tail, deadline) in list(self._takeovers.items()):
            if now >= deadline or any(isinstance(e, CommitEvent) for e in tail.poll()):
                del self._takeovers[replica_id]
        return bool(self._takeovers)

    def breakable(self, eligible: set[str] | None = None) -> list[Replica]:
        """Running replicas not hung nor throttled already (among `eligible` ids, if given)."""
        return [
            r
            for r in self.replicas
            if r.running
            and not r.hung
            and not r.throttled
            and (eligible is None or r.replica_id in eligible)
        ]

    def inject(
        self, mode: str, rng: random.Random, *, eligible: set[str] | None = None
    ) -> str | None:
        """Breaks one running replica (among `eligible` ids, if given) on purpose; returns its
        id, or None if no replica qualified."""
        candidates = self.breakable(eligible)
        if not candidates:
            return None
        replica = rng.choice(candidates)
        rank: int | None = None
        if mode == "process":
            rank = rng.randrange(len(replica.procs))
            replica.procs[rank].send_signal(signal.SIGKILL)
        elif mode == "replica":
            for proc in replica.procs:
                proc.send_signal(signal.SIGKILL)
        elif mode == "hang":
            # One rank stops making progress: its heartbeats stop, the health agent reports it,
            # and the eviction tears the replica down (its agent kills it, its other ranks exit).
            rank = rng.randrange(len(replica.procs))
            replica.procs[rank].send_signal(signal.SIGSTOP)
            replica.hung = True
        elif mode == "slow":
            replica.unthrottle()
            replica.throttle = Throttle(replica.procs)
            replica.throttle.start()
        else:
            raise ValueError(f"unknown kill mode {mode!r}; choose from {KILL_MODES}")
        self.events.write(InjectEvent(replica=replica.replica_id, mode=mode, rank=rank))
        return replica.replica_id

    def evicted(self, replica_id: str) -> None:
        """The quorum service evicted a replica. Without a health service, nothing else tears a
        hung one (the injector stopped it) down, so it is replaced here; with one, its node
        agent does that. A live one that was merely slow rejoins by itself."""
        replica = self.by_id(replica_id)
        if self.command.health_agents or replica is None or self.stopping:
            return
        if replica.running and replica.hung:
            self.fail(replica, "hung: evicted by the quorum service")

    def stop_all(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; spares go at once."""
        self.stopping = True
        self.spares.stop()
        for replica in self.replicas:
            replica.unthrottle()
        terminate_all([p for r in self.replicas for p in r.procs], grace)
        for replica in self.replicas:
            replica.procs = []
