"""`fthsdp up --replicas R -- CMD`: the job's replicas as local rank processes of your command.

Each replica is `ranks` processes of CMD, given what `torchrun` would give them (`RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`: a fresh port per
incarnation) plus the stack's env file variables and the replica's `FTHSDP_REPLICA_ID`,
`FTHSDP_REPLICA_INDEX`, `FTHSDP_TOTAL_REPLICAS`, so `dist.init_process_group()` and
`fthsdp.ManagerConfig.from_env()` need nothing else; at the first launch also
`FTHSDP_AWAIT_REPLICAS_S`, so the replicas take their first step together (0 at a restart).
Output goes to `RUN_DIR/logs/<replica>.log`.

The replica is the unit of failure: a rank that exits non-zero (or by a signal) takes the rest of
its replica down, the quorum service is told at once (the survivors' next quorum leaves it out;
the restart waits for that report, at most `REPORT_WAIT_S`, so it never evicts the new
incarnation), and the replica starts again as a new incarnation that catches up from its peers.
With `spares`, warm spare processes of CMD wait for an identity (`fthsdp.worker.spare`: the script
calls `fthsdp.take_identity()` after building its model, before `init_process_group`); a restart
takes as many as the replica has ranks when that many are warm, at once, and otherwise starts fresh
processes after `restart_delay_s`. The pool refills one spare at a time, not within `REFILL_HOLD_S`
of a takeover. A replica whose ranks all exit 0 is finished; the job is finished when every replica
is. A replica failing `max_failures_in_a_row` times, each within `RestartPolicy.stable_after_s` of
its start, is a crash loop (a bad command): the launcher gives up."""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fthsdp.deploy import processes
from fthsdp.deploy.processes import (
    GaveUp,
    RestartPolicy,
    free_port,
    kill_all,
    terminate_all,
)
from fthsdp.deploy.spares import SparePool
from fthsdp.worker.spare import Identity

log = logging.getLogger(__name__)

REPORT_WAIT_S = 3.0
"""Longest a failed replica's restart waits for its eviction report to be done."""
REFILL_HOLD_S = 10.0
"""How long a takeover holds back the pool's refill: a spare warming up takes a core for
seconds, and started as the taken spares join it would slow their catch-up on a small host."""
MAX_SPARES = 64
MAX_PROCESSES = 1024
"""Ranks (replicas x ranks) one launcher starts on one host."""


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The job `fthsdp up` runs beside the stack."""

    command: tuple[str, ...]
    """The rank's command line (the same for every rank and spare)."""
    replicas: int
    ranks: int = 1
    """Rank processes per replica."""
    spares: int = 0
    """Warm spare processes kept ready (the command must call `fthsdp.take_identity()`)."""
    restart_delay_s: float = 1.0
    """Wait before a failed replica starts fresh processes (spares take over at once)."""
    max_failures_in_a_row: int = 10
    """Quick failures of one replica after which the launcher gives up (0: never restart)."""
    await_replicas_s: float = 30.0
    """At the job's first launch, how long each replica's leader waits for every replica to
    register before its first step (`FTHSDP_AWAIT_REPLICAS_S`, read by
    `ManagerConfig.from_env`); restarts get 0 and join the running job at once."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("the job needs a command (after --)")
        if self.replicas < 1 or self.ranks < 1:
            raise ValueError("--replicas and --ranks must be at least 1")
        if self.replicas * self.ranks > MAX_PROCESSES:
            raise ValueError(f"at most {MAX_PROCESSES} rank processes (replicas x ranks)")
        if not 0 <= self.spares <= MAX_SPARES:
            raise ValueError(f"--spares must be in 0..{MAX_SPARES}")
        if self.restart_delay_s < 0 or self.max_failures_in_a_row < 0:
            raise ValueError("the restart delay and the failure limit must not be negative")
        if not 0 <= self.await_replicas_s <= 3600:
            raise ValueError("--await-replicas-s must be in 0..3600")


class FailureSink(Protocol):
    """Where the launcher reports a failed replica (`deploy.failure_reporter` for `up`)."""

    def send(self, replica_id: str, reason: str) -> None:
        """Asks for the replica's eviction; must not block for long."""

    def acknowledged(self) -> list[str]:
        """Replica ids whose reports are done (made or given up) since the last call."""


@dataclass(eq=False)
class _Replica:
    replica_id: str
    index: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    exited: dict[int, int] = field(default_factory=dict)
    """Rank -> exit code of this incarnation's ranks that ended."""
    started_at: float = 0.0
    restart_at: float | None = None
    reported_by: float | None = None
    """While its eviction report is out: when the restart goes ahead without it."""
    failures_in_a_row: int = 0
    starts: int = 0
    finished: bool = False


class JobLauncher:
    """Starts the job's replicas, restarts the ones that fail, keeps the spare pool."""

    def __init__(
        self,
        config: JobConfig,
        env: Mapping[str, str],
        log_dir: Path,
        *,
        failures: FailureSink,
        report: Callable[[str], None],
        policy: RestartPolicy | None = None,
        die_with_parent: bool = False,
    ) -> None:
        """`die_with_parent`: ranks and spares get SIGTERM when this process dies (a pre-exec
        step: only for a launcher that runs no gRPC threads, as `up`)."""
        self._config = config
        self._env = dict(env)
        self._logs = log_dir
        self._failures = failures
        self._report = report
        self._policy = dataclasses.replace(
            policy or RestartPolicy(), max_failures_in_a_row=config.max_failures_in_a_row
        )
        self.replicas = [_Replica(f"r{i}", i) for i in range(config.replicas)]
        self._preexec = processes.die_with_parent(os.getpid()) if die_with_parent else None
        self.spares = SparePool(
            config.spares, config.command, self._env, log_dir, preexec=self._preexec
        )
        self._warm_shown = -1
        self._refill_at = 0.0
        """The pool refills from then on (held back after a takeover)."""

    def start_all(self) -> None:
        self._logs.mkdir(parents=True, exist_ok=True)
        for replica in self.replicas:
            self._start(replica, time.monotonic())

    def poll(self, now: float) -> bool:
        """One round: reaps ranks, takes failed replicas down, restarts them when due, refills
        the pool. True once every replica finished."""
        if self.spares.size:
            if now >= self._refill_at:
                self.spares.refill()
            warm = self.spares.warm
            if warm != self._warm_shown:
                self._warm_shown = warm
                self._report(f"spares warm: {warm}/{self.spares.size}")
        reported = set(self._failures.acknowledged())
        for replica in self.replicas:
            if replica.reported_by is not None:
                if replica.replica_id in reported or now >= replica.reported_by:
                    replica.reported_by = None
                    self._schedule_restart(replica, now)
                continue
            if replica.restart_at is not None:
                if now >= replica.restart_at:
                    self._start(replica, now)
                continue
            if not replica.finished:
                self._reap(replica, now)
        return all(replica.finished for replica in self.replicas)

    def stop_all(self, grace_s: float) -> None:
        """SIGTERM to every rank, SIGKILL after `grace_s`; spares go at once."""
        self.spares.stop()
        terminate_all([proc for replica in self.replicas for proc in replica.procs], grace_s)
        for replica in self.replicas:
            replica.procs = []

    def _reap(self, replica: _Replica, now: float) -> None:
        for rank, proc in enumerate(replica.procs):
            if rank in replica.exited:
                continue
            code = proc.poll()
            if code is None:
                continue
            replica.exited[rank] = code
            if code != 0:
                self._fail(replica, f"rank {rank} exited with {code}", now)
                return
        if replica.procs and len(replica.exited) == len(replica.procs):
            replica.finished = True
            replica.procs = []
            self._report(f"replica {replica.replica_id} finished")

    def _fail(self, replica: _Replica, reason: str, now: float) -> None:
        kill_all(replica.procs)
        replica.procs = []
        self._failures.send(replica.replica_id, reason)
        replica.reported_by = now + REPORT_WAIT_S
        replica.failures_in_a_row = self._policy.count_failure(
            replica.failures_in_a_row, now - replica.started_at
        )
        if replica.failures_in_a_row > self._policy.max_failures_in_a_row:
            raise GaveUp(
                f"replica {replica.replica_id} failed {replica.failures_in_a_row} times in a row "
                f"(last: {reason})"
            )
        self._report(f"replica {replica.replica_id}: {reason}; restarting")

    def _schedule_restart(self, replica: _Replica, now: float) -> None:
        """Warm spares take over at once; fresh processes after the restart delay."""
        warm = self.spares.warm >= self._config.ranks
        replica.restart_at = now + (0.0 if warm else self._config.restart_delay_s)

    def _start(self, replica: _Replica, now: float) -> None:
        port = free_port()
        replica.starts += 1
        replica.exited = {}
        replica.restart_at = None
        replica.started_at = now
        log_file = self._logs / f"{replica.replica_id}.log"
        taken = self.spares.take(self._config.ranks) if replica.starts > 1 else None
        if taken is not None:
            for rank, spare in enumerate(taken):
                env = self.identity(replica, rank, port)
                spare.hand_over(Identity(env=env, log_file=str(log_file)))
            replica.procs = [spare.proc for spare in taken]
            self._refill_at = now + REFILL_HOLD_S
            self._report(f"replica {replica.replica_id} taken over by {len(taken)} warm spare(s)")
            return
        with log_file.open("ab") as out:
            replica.procs = [
                subprocess.Popen(
                    list(self._config.command),
                    env={**self._env, **self.identity(replica, rank, port)},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    preexec_fn=self._preexec,
                )
                for rank in range(self._config.ranks)
            ]
        if replica.starts > 1:
            self._report(f"replica {replica.replica_id} restarted as fresh processes")

    def identity(self, replica: _Replica, rank: int, port: int) -> dict[str, str]:
        """What makes a process rank `rank` of `replica` (torchrun's variables and fthsdp's)."""
        ranks = str(self._config.ranks)
        return {
            "FTHSDP_REPLICA_ID": replica.replica_id,
            "FTHSDP_REPLICA_INDEX": str(replica.index),
            "FTHSDP_TOTAL_REPLICAS": str(self._config.replicas),
            "FTHSDP_AWAIT_REPLICAS_S": str(
                self._config.await_replicas_s if replica.starts == 1 else 0.0
            ),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": ranks,
            "LOCAL_WORLD_SIZE": ranks,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }

    def pids(self) -> dict[str, list[int]]:
        """Replica id -> its running ranks' pids (for the state file)."""
        return {r.replica_id: [p.pid for p in r.procs if p.poll() is None] for r in self.replicas}


def rank_env(
    stack_env: Mapping[str, str], inherited: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment every rank and spare starts from: this process's, and the stack's."""
    base = dict(os.environ if inherited is None else inherited)
    base.update(stack_env)
    return base


def job_summary(config: JobConfig) -> Sequence[str]:
    """Lines `up` prints about the job it runs."""
    spares = f", {config.spares} warm spare(s)" if config.spares else ""
    shape = f"{config.replicas} x {config.ranks} ranks{spares}"
    return [f"job         {shape}: {shlex.join(config.command)}"]
