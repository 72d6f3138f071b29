"""`fthsdp demo`: the whole stack on this machine, a tiny GPT, and failures on a schedule.

The quorum service runs embedded in this process, the checkpoint service as a sidecar process,
and every rank as its own process (see `ReplicaSupervisor`). At the end the replicas are brought
to one agreed step, and the run's logs become a JSON report and a PNG plot. With
`hosts="netns"` every host is a network namespace (`deploy.netns_demo`)."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import queue
import random
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from fthsdp.deploy.demo.events import (
    CommitEvent,
    EndEvent,
    EventLog,
    InjectEvent,
    JsonlTail,
    QuorumEvent,
    RunEvent,
)
from fthsdp.deploy.demo.mixes import MAX_STATE_PAD_MB, SEQ_LEN_MIXES
from fthsdp.deploy.demo.supervisor import KILL_MODES, ReplicaCommand, ReplicaSupervisor
from fthsdp.deploy.netns_demo import HOSTS, NETNS_KILL_MODES, NetnsHosts
from fthsdp.deploy.service_commands import log_flags
from fthsdp.deploy.stack import LocalStack, Placement
from fthsdp.services.common import logs
from fthsdp.services.health.client_http import HealthClient
from fthsdp.services.health.config import FAILURE_ACTIONS
from fthsdp.services.quorum.client import QuorumClient, QuorumUnavailableError
from fthsdp.services.quorum.domain import FAILSLOW_POLICIES
from fthsdp.worker.faults import parse_faults

log = logging.getLogger(__name__)
_POLL_BUDGET = timedelta(seconds=1)
"""How long one status poll of the driver retries while no instance answers as leader: the
driver's loop must keep supervising (and restarting a dead store) meanwhile."""
_START_TIMEOUT = timedelta(seconds=120)
"""Start-up: how long the training time waits for every replica's first commit (the end
phase's `settle_timeout` is another matter: a test may shorten it to leave a replica out)."""
_STOP_LEAD = timedelta(seconds=1)
"""How far ahead, in time at the job's recent step rate, the agreed last step lies (at least
`_STOP_LEAD_MIN_STEPS`): far more than the launcher's read of the step and write of the stop
file take on a loaded host."""
_STOP_LEAD_MIN_STEPS = 5
_RATE_WINDOW_S = 5.0
"""The step rate is measured over the quorum observations of the last few seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Everything `fthsdp demo` can be told."""

    replicas: int = 3
    """Replicas (units of failure) in the job."""
    ranks: int = 2
    """Ranks (processes) per replica."""
    duration: timedelta = timedelta(seconds=120)
    """Training time, counted once every replica is healthy, before the end phase (failures
    are injected only during it)."""
    kill_every: timedelta | None = timedelta(seconds=25)
    """Period of injected failures; None injects none."""
    kill_mode: str = "process"
    """process: SIGKILL one rank; replica: SIGKILL every rank of a replica; hang: SIGSTOP one
    rank; slow: throttle every rank of a replica for a while (see `supervisor.KILL_MODES`)."""
    seed: int = 0
    """Seeds the failure schedule's choices and the model's initialisation."""
    run_dir: Path = Path("runs/demo")
    """Logs, the token file, checkpoints, the report and the plot go here."""
    micro_batch: int = 4
    """Samples per rank per micro-step."""
    micro_steps: int = 1
    """Each replica's even share of micro-steps per step (gradient accumulation)."""
    failslow_policy: str = "off"
    """The quorum service's fail-slow mitigation: off, rebalance (move micro-steps from a slow
    replica to the fast ones; needs `micro_steps` > 1), evict or auto."""
    durable_every_steps: int = 25
    """A durable checkpoint every K steps (0 disables)."""
    heartbeat_timeout: timedelta = timedelta(seconds=1)
    """The quorum service evicts a replica whose leader was silent this long."""
    join_timeout: timedelta = timedelta(seconds=2)
    """How long a quorum waits for a live replica that has not asked yet (the stall bound)."""
    min_replicas: int | None = None
    """Smallest quorum; default half of `replicas`, rounded up, so a minority never trains alone
    (I6). The injector never breaks a replica that would leave fewer healthy ones than this."""
    fsdp: bool = False
    """Shard each replica's model over its ranks with FSDP2 (HSDP) instead of replicating it."""
    overlap_backward: bool = False
    """Exchange gradient buckets across replicas while backward still runs (not with `fsdp`)."""
    loader_workers: int = 0
    """DataLoader worker processes per rank (0: load in the rank itself)."""
    state_pad_mb: int = 0
    """MiB of constant bytes each rank adds to its replicated state (`ballast`), so snapshots
    and catch-up fetches move as much as a larger model's would; 0 adds none."""
    seq_len_mix: str = "uniform"
    """Document lengths of the samples (`corpus.SEQ_LEN_MIXES`): uniform (one window each),
    phases (packed short and long documents, alternating) or random (packed, mixed)."""
    restart_policy: str = "replica"
    """replica: only a failed replica restarts; job: all restart from the last durable
    checkpoint on any failure (the synchronous baseline that `bench.recovery` compares with)."""
    settle_timeout: timedelta = timedelta(seconds=90)
    """End phase: how long to wait for every replica to be healthy before stopping."""
    live: bool = True
    """Show the live terminal view; without it, `progress` lines per replica every
    `progress_every`."""
    progress_every: timedelta = timedelta(seconds=10)
    """Without the live view: how often each replica's progress line is printed."""
    log_format: str | None = None
    """`--log-format` of every service and rank process (None: each one's default, or the
    FTHSDP_LOG_FORMAT they inherit)."""
    log_level: str | None = None
    """`--log-level` of every service and rank process (None: each one's default)."""
    checkpoint_dir: Path | None = None
    """Durable checkpoints and data positions (default `run_dir/checkpoints`); point a second
    run at the first one's to resume it (a full restart)."""
    faults: str = ""
    """Planned rank deaths, `replica:rank:step:point,...` (see `worker.faults`), each once."""
    redis: bool = False
    """Run the quorum service as a leader and a standby on a local redis-server (then
    `kill_mode="quorum"` SIGKILLs the leader and the standby takes over with the membership)."""
    health: bool = True
    """Run the health service (central + one node agent per host) and send it the ranks'
    telemetry; its incidents go into the report."""
    on_failure: str = "kill"
    """What the health service does with a dead or hung rank's replica besides evicting it:
    kill (tear it down: its agent kills its processes, its ranks exit) or report."""
    hang_timeout: timedelta = timedelta(seconds=3)
    """A collective open this long is a hang (the health service's `--hang-timeout-ms`); the
    demo's steps take tens of milliseconds, so 3 s is far above a healthy one."""
    spares: int = 0
    """Warm spare rank processes kept ready (torch imported, model built): a restarted replica
    takes `ranks` of them when that many are alive, else starts fresh processes."""
    store_down: timedelta = timedelta(seconds=10)
    """`kill_mode="store"`: how long the killed redis-server stays down before the stack's
    supervision brings it back (with its append-only file)."""
    hosts: str = "loopback"
    """loopback: every host on this machine's loopback; netns: each host (control plane, health
    central, every replica) in its own network namespace with its own address (root only), and
    the network faults of `NETNS_KILL_MODES`."""
    fault_for: timedelta = timedelta(seconds=5)
    """A network fault (`NETNS_KILL_MODES`) is healed this long after it began."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.ranks < 1:
            raise ValueError("replicas and ranks must be >= 1")
        if not 1 <= self.micro_steps <= 64:
            raise ValueError("micro_steps must be in 1..64")
        if self.failslow_policy not in FAILSLOW_POLICIES:
            raise ValueError(f"failslow_policy must be one of {FAILSLOW_POLICIES}")
        if not 0 <= self.loader_workers <= 64:
            raise ValueError("loader_workers must be in 0..64")
        if not 0 <= self.state_pad_mb <= MAX_STATE_PAD_MB:
            raise ValueError(f"state_pad_mb must be in 0..{MAX_STATE_PAD_MB}")
        if self.seq_len_mix not in SEQ_LEN_MIXES:
            raise ValueError(f"seq_len_mix must be one of {SEQ_LEN_MIXES}")
        if self.fsdp and self.overlap_backward:
            raise ValueError("overlap_backward is not supported with fsdp")
        if self.kill_mode not in KILL_MODES:
            raise ValueError(f"kill_mode must be one of {KILL_MODES}")
        if self.kill_mode.startswith("store") and not self.redis:
            raise ValueError(f"kill_mode {self.kill_mode!r} needs redis (the store is redis)")
        if not 0 <= self.spares <= 64:
            raise ValueError("spares must be in 0..64")
        if self.hosts not in HOSTS:
            raise ValueError(f"hosts must be one of {HOSTS}")
        if self.kill_mode in NETNS_KILL_MODES and self.hosts != "netns":
            raise ValueError(f"kill_mode {self.kill_mode!r} needs hosts='netns'")
        if self.kill_mode.startswith("leader-") and not self.redis:
            raise ValueError(f"kill_mode {self.kill_mode!r} needs redis (a standby to take over)")
        if self.hosts == "netns" and self.spares:
            raise ValueError("spares are not supported with hosts='netns'")
        if self.fault_for <= timedelta(0):
            raise ValueError("fault_for must be positive")
        if self.store_down < timedelta(0):
            raise ValueError("store_down must not be negative")
        if self.duration <= timedelta(0):
            raise ValueError("duration must be positive")
        if self.kill_every is not None and self.kill_every <= timedelta(0):
            raise ValueError("kill_every must be positive")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.replicas:
            raise ValueError("min_replicas must be in 1..replicas")
        if self.faults:
            parse_faults(self.faults)
        if self.on_failure not in FAILURE_ACTIONS:
            raise ValueError(f"on_failure must be one of {FAILURE_ACTIONS}")
        if self.hang_timeout <= timedelta(0):
            raise ValueError("hang_timeout must be positive")
        if self.progress_every <= timedelta(0):
            raise ValueError("progress_every must be positive")
        if self.log_format is not None and self.log_format not in logs.FORMATS:
            raise ValueError(f"log_format must be one of {logs.FORMATS}")
        if self.log_level is not None:
            logs.parse_level(self.log_level)

    @property
    def log_flags(self) -> tuple[str, ...]:
        """The logging flags every process the demo starts is given."""
        return log_flags(self.log_level, self.log_format)

    @property
    def quorum_floor(self) -> int:
        """`min_replicas`, or half the replicas rounded up: half of the job is no minority."""
        return self.min_replicas or (self.replicas + 1) // 2


class _QuorumView:
    """The latest quorum, from the service's watch stream and from polling its status (a round
    that keeps its quorum id, such as a replica turning healthy, pushes no event)."""

    def __init__(self, events: EventLog) -> None:
        self._events = events
        self._lock = threading.Lock()
        self._key: tuple[object, ...] = ()
        self.quorum_id = -1
        self.healthy: tuple[str, ...] = ()
        self.max_step = 0
        self.evictions: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._steps: collections.deque[tuple[float, int]] = collections.deque()

    def step_rate(self) -> float:
        """Steps per second over the last few seconds of observations (0 with too few)."""
        with self._lock:
            if len(self._steps) < 2:
                return 0.0
            (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
        return max(0.0, (s1 - s0) / (t1 - t0)) if t1 > t0 else 0.0

    def observe(self, client: QuorumClient) -> None:
        """Reads the latest quorum and logs it when it changed."""
        status = client.status(history_limit=1)
        if not status.quorums:
            return
        latest = status.quorums[-1]
        key = (latest.quorum_id, latest.members, latest.healthy)
        now = time.monotonic()
        with self._lock:
            self.max_step = latest.max_step
            self._steps.append((now, latest.max_step))
            while self._steps and self._steps[0][0] < now - _RATE_WINDOW_S:
                self._steps.popleft()
            if key == self._key:
                return
            self._key = key
            self.quorum_id = latest.quorum_id
            self.healthy = tuple(latest.healthy)
            self._events.write(
                QuorumEvent(
                    quorum_id=latest.quorum_id,
                    members=tuple(latest.members),
                    healthy=tuple(latest.healthy),
                    max_step=latest.max_step,
                )
            )


def _watch(stack: LocalStack, view: _QuorumView, stop: threading.Event) -> None:
    """Follows the watch stream, reconnecting when the quorum service restarts."""
    while not stop.is_set():
        client = stack.quorum_client()
        try:
            view.observe(client)
            for event in client.watch():
                if stop.is_set():
                    return
                if event.kind == "quorum":
                    view.observe(client)
                elif event.kind == "evicted" and event.replica_id:
                    view.evictions.put(event.replica_id)
        except Exception as exc:
            log.debug("quorum watch interrupted: %s", exc)
        finally:
            client.close()
        stop.wait(0.2)


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Runs the demo and returns the report (also written to `run_dir/report.json`)."""
    from fthsdp.deploy.demo.plot import write_plot
    from fthsdp.deploy.demo.report import build_report

    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stop.json").unlink(missing_ok=True)
    token_file = run_dir / "token"
    token_file.write_text(secrets.token_urlsafe(32))
    token_file.chmod(0o600)
    events = EventLog(run_dir / "supervisor.jsonl")
    rng = random.Random(config.seed)
    stop = threading.Event()
    replica_ids = [f"r{i}" for i in range(config.replicas)]
    netns = NetnsHosts(replica_ids, redis=config.redis) if config.hosts == "netns" else None
    with netns or contextlib.nullcontext(Placement()) as placement:
        incidents = _run(config, run_dir, token_file, events, rng, stop, placement, netns)
    report = build_report(run_dir)
    report["incidents"] = incidents
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    write_plot(report, run_dir / "report.png")
    return report


def _run(
    config: DemoConfig,
    run_dir: Path,
    token_file: Path,
    events: EventLog,
    rng: random.Random,
    stop: threading.Event,
    placement: Placement,
    netns: NetnsHosts | None,
) -> list[dict[str, Any]]:
    """Starts the stack and the replicas on `placement`, trains, settles and stops; returns the
    health service's incidents."""
    from fthsdp.deploy.demo.view import LiveView, run_live, run_progress

    replica_ids = [f"r{i}" for i in range(config.replicas)]
    with LocalStack(
        run_dir=run_dir,
        token_file=token_file,
        hosts=replica_ids,
        checkpoint_dir=config.checkpoint_dir or run_dir / "checkpoints",
        heartbeat_timeout=config.heartbeat_timeout,
        join_timeout=config.join_timeout,
        min_replicas=config.quorum_floor,
        failslow_policy=config.failslow_policy,
        redis=config.redis,
        health=config.health,
        failure_action=config.on_failure,
        hang_timeout=config.hang_timeout,
        log_flags=config.log_flags,
        placement=placement,
    ) as stack:
        if stack.health_url:
            # The token stays in its file: printing it would put it in terminal scrollback.
            print(
                f"health dashboard: {stack.health_url}/dashboard#token=<contents of {token_file}>",
                flush=True,
            )
        command = ReplicaCommand(
            run_dir=run_dir,
            world_size=config.ranks,
            total_replicas=config.replicas,
            quorum_address=stack.quorum_address,
            checkpoint_urls={r: stack.sidecars[r].url for r in replica_ids},
            shm_dirs={r: str(stack.sidecars[r].shm_dir) for r in replica_ids},
            health_agents=stack.health_agents,
            prefixes={r: placement.prefix(r) for r in replica_ids},
            ftar_hosts={} if placement.loopback else {r: placement.address(r) for r in replica_ids},
            token_file=token_file,
            env={"FTHSDP_FAULTS": config.faults, "FTHSDP_FAULTS_DIR": str(run_dir / "faults")},
            extra_args=(
                "--micro-batch", str(config.micro_batch),
                "--micro-steps", str(config.micro_steps),
                "--seed", str(config.seed),
                "--durable-every-steps", str(config.durable_every_steps),
                *(("--fsdp",) if config.fsdp else ()),
                *(("--overlap-backward",) if config.overlap_backward else ()),
                "--loader-workers", str(config.loader_workers),
                "--state-pad-mb", str(config.state_pad_mb),
                "--seq-len-mix", config.seq_len_mix,
                *config.log_flags,
            ),
        )  # fmt: skip
        supervisor = ReplicaSupervisor(
            command,
            events,
            on_failure=lambda rid, why: stack.report_failure(rid, why),
            restart_policy=config.restart_policy,
            spares=config.spares,
        )
        events.write(
            RunEvent(
                replicas=tuple(r.replica_id for r in supervisor.replicas),
                world_size=config.ranks,
                kill_every_s=config.kill_every.total_seconds() if config.kill_every else None,
                kill_mode=config.kill_mode,
                seed=config.seed,
                samples_per_step=config.micro_batch * config.ranks,
                total_replicas=config.replicas,
                min_replicas=config.quorum_floor,
            )
        )
        quorum = _QuorumView(events)
        watcher = threading.Thread(
            target=_watch, args=(stack, quorum, stop), name="demo-watch", daemon=True
        )
        watcher.start()
        live_view = LiveView(run_dir, [r.replica_id for r in supervisor.replicas])
        every_s = config.progress_every.total_seconds()
        viewer = threading.Thread(
            target=run_live if config.live else run_progress,
            args=(live_view, stop) if config.live else (live_view, stop, every_s),
            name="demo-view",
            daemon=True,
        )
        viewer.start()
        driver = _Driver(config, stack, supervisor, quorum, netns)
        try:
            supervisor.start_all()
            driver.train(rng)
            driver.settle(run_dir)
        finally:
            supervisor.stop_all(grace=10.0)
            events.write(EndEvent())
            stop.set()
            events.close()
            if netns is not None:
                netns.heal_due(everything=True)  # the incidents are read through the bridge
                netns.join_probes()
        return _health_incidents(stack, token_file)


def _health_incidents(stack: LocalStack, token_file: Path) -> list[dict[str, Any]]:
    """What the health service detected during the run (oldest first); empty without it."""
    if not stack.health_url:
        return []
    try:
        with HealthClient(stack.health_url, token_file.read_text().strip()) as client:
            found = client.incidents(limit=1000)
    except Exception as exc:  # the report stands without them
        log.warning("could not read the health service's incidents: %s", exc)
        return []
    return list(reversed(found))


def _max_committed(run_dir: Path) -> int:
    """The highest step any replica's log shows committed (0 before any)."""
    steps = [
        event.step
        for path in sorted((run_dir / "replicas").glob("*.jsonl"))
        for event in JsonlTail(path, strict=False).poll()
        if isinstance(event, CommitEvent)
    ]
    return max(steps, default=0)


class _Driver:
    """The launcher's main loop: supervise, inject on schedule, then settle and stop."""

    def __init__(
        self,
        config: DemoConfig,
        stack: LocalStack,
        supervisor: ReplicaSupervisor,
        quorum: _QuorumView,
        netns: NetnsHosts | None = None,
    ) -> None:
        self.config = config
        self.stack = stack
        self.supervisor = supervisor
        self.quorum = quorum
        self.netns = netns
        self._replica_kill_at = float("inf")
        """`store-replica`: when to kill a replica while the store is down."""
        self._next_poll = 0.0

    def supervise(self) -> None:
        """One tick: heal network faults that are due, poll the quorum, replace evicted
        replicas, reap and restart processes."""
        if self.netns is not None:
            self.netns.heal_due()
        self.stack.supervise()
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + 0.25
            client = self.stack.quorum_client(connect_timeout=_POLL_BUDGET)
            try:
                self.quorum.observe(client)
            except Exception as exc:  # the service may be restarting
                log.debug("status poll failed: %s", exc)
            finally:
                client.close()
        while True:
            try:
                self.supervisor.evicted(self.quorum.evictions.get_nowait())
            except queue.Empty:
                break
        self.supervisor.poll()

    def train(self, rng: random.Random) -> None:
        """Trains for `duration` from the moment every replica is healthy and the first step
        has committed (start-up, which takes seconds on a loaded machine and longer still with
        data-loader workers to spawn, does not count), injecting a failure every `kill_every`
        except in the last stretch. A failure before the first commit would test nothing: the
        victim restarts at step 0 with nothing to catch up."""
        config = self.config
        everyone = {r.replica_id for r in self.supervisor.replicas}
        deadline = time.monotonic() + _START_TIMEOUT.total_seconds()
        while time.monotonic() < deadline and (
            set(self.quorum.healthy) != everyone or self.quorum.max_step < 1
        ):
            self.supervise()
            time.sleep(0.05)
        start = time.monotonic()
        end = start + config.duration.total_seconds()
        period = config.kill_every.total_seconds() if config.kill_every else None
        next_kill = start + period if period else float("inf")
        # No failures in the last stretch: the end phase needs every replica back.
        last_kill = end - min(10.0, config.duration.total_seconds() / 4)
        if config.kill_mode in NETNS_KILL_MODES:
            last_kill -= config.fault_for.total_seconds()  # healed before the end phase
        while time.monotonic() < end:
            self.supervise()
            now = time.monotonic()
            if now >= self._replica_kill_at and self._kill_replica(rng):
                self._replica_kill_at = float("inf")
            # A failure that is due but not allowed yet is tried again at the next tick.
            if now >= next_kill and (now >= last_kill or self._inject(rng)):
                next_kill = now + (period or float("inf"))
            time.sleep(0.05)

    def _inject(self, rng: random.Random) -> bool:
        """Breaks something; False when nothing may be broken now."""
        if self.config.kill_mode in NETNS_KILL_MODES:
            return self._inject_network(rng)
        if self.config.kill_mode == "quorum":
            self.supervisor.events.write(InjectEvent(replica=None, mode="quorum", rank=None))
            self.stack.restart_quorum()
            return True
        if self.config.kill_mode in ("store", "store-replica"):
            period = (self.config.kill_every or timedelta(0)).total_seconds()
            if self.stack.store_down() or time.monotonic() < self.stack.store_up_since + period:
                return False  # one outage at a time, each a full period after the last one
            self.supervisor.events.write(InjectEvent(replica=None, mode="store", rank=None))
            self.stack.kill_store(self.config.store_down)
            if self.config.kill_mode == "store-replica":
                self._replica_kill_at = time.monotonic() + min(
                    2.0, self.config.store_down.total_seconds() / 2
                )
            return True
        return self._kill_replica(rng, self.config.kill_mode)

    def _inject_network(self, rng: random.Random) -> bool:
        """A network fault (`NETNS_KILL_MODES`), one at a time; False when none may start now."""
        assert self.netns is not None
        mode = self.config.kill_mode
        if self.netns.faulty:
            return False
        period = self.config.fault_for.total_seconds()
        events = self.supervisor.events
        if mode.startswith("leader-"):
            leader = self.stack.quorum_leader_host()
            if leader is None:
                return False
            events.write(InjectEvent(replica=None, mode=mode, rank=None))
            if mode == "leader-blackhole":
                self.netns.inject_leader_blackhole(leader, period, self.stack, self.config.run_dir)
            else:
                self.netns.inject(mode, [leader], period)
            return True
        healthy = set(self.quorum.healthy)
        candidates = self.supervisor.breakable(healthy)
        if mode in ("blackhole", "flap") and len(candidates) - 1 < self.config.quorum_floor:
            return False  # never below the floor: see `_kill_replica`
        if not candidates:
            return False
        victim = rng.choice(candidates).replica_id
        events.write(InjectEvent(replica=victim, mode=mode, rank=None))
        self.netns.inject(mode, [victim], period)
        return True

    def _kill_replica(self, rng: random.Random, mode: str = "replica") -> bool:
        # Only replicas in the current quorum that are up: one that has not joined yet would
        # never be evicted (nobody knows it), and a hang of it would go unnoticed. And never
        # below the quorum floor: the job would then stop by design (I6), which measures the
        # policy, not the recovery. Failures still overlap whenever the floor allows it.
        healthy = set(self.quorum.healthy)
        if len(self.supervisor.breakable(healthy)) - 1 < self.config.quorum_floor:
            return False
        return self.supervisor.inject(mode, rng, eligible=healthy) is not None

    def settle(self, run_dir: Path) -> None:
        """Waits until every replica is healthy, then has all of them stop at one agreed step."""
        if self.netns is not None:
            self.netns.heal_due(everything=True)
        everyone = {r.replica_id for r in self.supervisor.replicas}
        deadline = time.monotonic() + self.config.settle_timeout.total_seconds()
        while time.monotonic() < deadline and set(self.quorum.healthy) != everyone:
            self.supervise()
            time.sleep(0.05)
        # A fresh read (retried while the service cannot answer, e.g. during a store outage,
        # when the view above is stale), plus a margin that outruns the write of stop.json at
        # the job's step rate: every rank must still be below stop_at when it first reads the
        # file, which it does before each step.
        while True:
            client = self.stack.quorum_client(connect_timeout=_POLL_BUDGET)
            try:
                self.quorum.observe(client)
                break
            except QuorumUnavailableError:
                if time.monotonic() > deadline:
                    raise
                self.supervise()
            finally:
                client.close()
        # The replicas' own logs as a floor: after a store outage the service's newest record
        # can be older than the steps trained meanwhile on the previous quorum.
        lead = max(
            _STOP_LEAD_MIN_STEPS, math.ceil(self.quorum.step_rate() * _STOP_LEAD.total_seconds())
        )
        stop_at = max(self.quorum.max_step, _max_committed(run_dir)) + lead
        # Atomic: a rank must never read a half-written file (it would train past stop_at
        # alone, waiting for a quorum that never comes).
        staging = run_dir / "stop.json.tmp"
        staging.write_text(json.dumps({"stop_at_step": stop_at}))
        staging.replace(run_dir / "stop.json")
        self.supervisor.stopping = True
        # Only the quorum's replicas train up to stop_at; one left out of it when the wait
        # for everyone ran out (evicted and left alone under the "report" policy) is stopped
        # by the shutdown, not waited for.
        stopping = [r for r in self.supervisor.replicas if r.replica_id in self.quorum.healthy]
        deadline = time.monotonic() + self.config.settle_timeout.total_seconds()
        while time.monotonic() < deadline and any(r.running for r in stopping):
            self.supervisor.poll()
            if any(not r.running for r in stopping):
                # Replicas stop in lockstep; one that has not followed the first within a
                # grace period is stuck waiting for a quorum that will not form again.
                deadline = min(deadline, time.monotonic() + 15.0)
            time.sleep(0.05)
