"""`fthsdp demo`: the whole stack on this machine, a tiny GPT, and failures on a schedule.

The quorum service runs embedded in this process, the checkpoint service as a sidecar process,
and every rank as its own process (see `Supervisor`). At the end the replicas are brought to one
agreed step, and the run's logs become a JSON report and a PNG plot."""

from __future__ import annotations

import json
import logging
import queue
import random
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from deploy.demo.supervisor import KILL_MODES, EventLog, ReplicaCommand, Supervisor
from deploy.stack import LocalStack

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Everything `fthsdp demo` can be told."""

    replicas: int = 3
    """Replicas (units of failure) in the job."""
    ranks: int = 2
    """Ranks (processes) per replica."""
    duration: timedelta = timedelta(seconds=120)
    """Training time before the end phase (failures are injected only during it)."""
    kill_every: timedelta | None = timedelta(seconds=25)
    """Period of injected failures; None injects none."""
    kill_mode: str = "process"
    """process: SIGKILL one rank; replica: SIGKILL every rank of a replica; hang: SIGSTOP it."""
    seed: int = 0
    """Seeds the failure schedule's choices and the model's initialisation."""
    run_dir: Path = Path("runs/demo")
    """Logs, the token file, checkpoints, the report and the plot go here."""
    micro_batch: int = 4
    """Samples per rank per step."""
    durable_every_steps: int = 25
    """A durable checkpoint every K steps (0 disables)."""
    heartbeat_timeout: timedelta = timedelta(seconds=1)
    """The quorum service evicts a replica whose leader was silent this long."""
    join_timeout: timedelta = timedelta(seconds=2)
    """How long a quorum waits for a live replica that has not asked yet (the stall bound)."""
    settle_timeout: timedelta = timedelta(seconds=90)
    """End phase: how long to wait for every replica to be healthy before stopping."""
    live: bool = True
    """Show the live terminal view."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.ranks < 1:
            raise ValueError("replicas and ranks must be >= 1")
        if self.kill_mode not in KILL_MODES:
            raise ValueError(f"kill_mode must be one of {KILL_MODES}")
        if self.duration <= timedelta(0):
            raise ValueError("duration must be positive")
        if self.kill_every is not None and self.kill_every <= timedelta(0):
            raise ValueError("kill_every must be positive")


@dataclass(slots=True)
class _QuorumView:
    """The latest quorum as pushed by the service's watch stream."""

    quorum_id: int = -1
    healthy: tuple[str, ...] = ()
    max_step: int = 0
    evictions: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)


def _watch(stack: LocalStack, events: EventLog, view: _QuorumView, stop: threading.Event) -> None:
    client = stack.quorum_client()
    try:
        for event in client.watch():
            if stop.is_set():
                return
            if event.kind == "quorum":
                status = client.status()
                latest = status.quorums[-1] if status.quorums else None
                if latest is None:
                    continue
                view.quorum_id = latest.quorum_id
                view.healthy = tuple(latest.healthy)
                view.max_step = latest.max_step
                events.write(
                    "quorum",
                    quorum_id=latest.quorum_id,
                    members=list(latest.members),
                    healthy=list(latest.healthy),
                    max_step=latest.max_step,
                )
            elif event.kind == "evicted" and event.replica_id:
                view.evictions.put(event.replica_id)
    except Exception as exc:
        if not stop.is_set():
            log.warning("quorum watch ended: %s", exc)
    finally:
        client.close()


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Runs the demo and returns the report (also written to `run_dir/report.json`)."""
    from deploy.demo.plot import write_plot
    from deploy.demo.report import build_report
    from deploy.demo.view import LiveView, run_live

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
    with LocalStack(
        run_dir=run_dir,
        token_file=token_file,
        hosts=replica_ids,
        heartbeat_timeout=config.heartbeat_timeout,
        join_timeout=config.join_timeout,
    ) as stack:
        command = ReplicaCommand(
            run_dir=run_dir,
            world_size=config.ranks,
            total_replicas=config.replicas,
            quorum_address=stack.quorum_address,
            checkpoint_urls={r: stack.sidecars[r].url for r in replica_ids},
            shm_dirs={r: str(stack.sidecars[r].shm_dir) for r in replica_ids},
            token_file=token_file,
            extra_args=(
                "--micro-batch", str(config.micro_batch),
                "--seed", str(config.seed),
                "--durable-every-steps", str(config.durable_every_steps),
            ),
        )  # fmt: skip
        supervisor = Supervisor(
            command, events, on_failure=lambda rid, why: stack.report_failure(rid, why)
        )
        events.write(
            "run",
            replicas=[r.replica_id for r in supervisor.replicas],
            world_size=config.ranks,
            kill_every_s=config.kill_every.total_seconds() if config.kill_every else None,
            kill_mode=config.kill_mode,
            seed=config.seed,
            samples_per_step=config.micro_batch * config.ranks,
            total_replicas=config.replicas,
        )
        quorum = _QuorumView()
        watcher = threading.Thread(
            target=_watch, args=(stack, events, quorum, stop), name="demo-watch", daemon=True
        )
        watcher.start()
        live_view = LiveView(run_dir, [r.replica_id for r in supervisor.replicas])
        viewer = threading.Thread(
            target=run_live, args=(live_view, stop), name="demo-view", daemon=True
        )
        if config.live:
            viewer.start()
        try:
            supervisor.start_all()
            _train(config, supervisor, quorum, rng)
            _settle(config, supervisor, quorum, run_dir)
        finally:
            supervisor.stop_all(grace=10.0)
            events.write("end")
            stop.set()
            events.close()
    report = build_report(run_dir)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    write_plot(report, run_dir / "report.png")
    return report


def _supervise(supervisor: Supervisor, quorum: _QuorumView) -> None:
    while True:
        try:
            supervisor.evicted(quorum.evictions.get_nowait())
        except queue.Empty:
            break
    supervisor.poll()


def _train(
    config: DemoConfig, supervisor: Supervisor, quorum: _QuorumView, rng: random.Random
) -> None:
    start = time.monotonic()
    end = start + config.duration.total_seconds()
    period = config.kill_every.total_seconds() if config.kill_every else None
    next_kill = start + period if period else float("inf")
    # No failures in the last stretch: the end phase needs every replica back.
    last_kill = end - min(10.0, config.duration.total_seconds() / 4)
    while time.monotonic() < end:
        _supervise(supervisor, quorum)
        now = time.monotonic()
        if period and now >= next_kill:
            if now < last_kill:
                supervisor.inject(config.kill_mode, rng)
            next_kill = now + period
        time.sleep(0.05)


def _settle(config: DemoConfig, supervisor: Supervisor, quorum: _QuorumView, run_dir: Path) -> None:
    """Waits until every replica is healthy, then has all of them stop at one agreed step."""
    everyone = {r.replica_id for r in supervisor.replicas}
    deadline = time.monotonic() + config.settle_timeout.total_seconds()
    while time.monotonic() < deadline and set(quorum.healthy) != everyone:
        _supervise(supervisor, quorum)
        time.sleep(0.05)
    stop_at = quorum.max_step + 3
    (run_dir / "stop.json").write_text(json.dumps({"stop_at_step": stop_at}))
    supervisor.stopping = True
    deadline = time.monotonic() + config.settle_timeout.total_seconds()
    while time.monotonic() < deadline and any(r.running for r in supervisor.replicas):
        supervisor.poll()
        time.sleep(0.05)
