"""`fthsdp up`: the fthsdp control plane alone, as supervised local processes.

It starts `python -m fthsdp.services.quorum`, `python -m fthsdp.services.checkpoint` and
`python -m fthsdp.services.health --mode central`, each its own process with its log under
`RUN_DIR/logs/`, waits until they answer `/readyz`, then writes an env file

    FTHSDP_QUORUM=127.0.0.1:PORT[,127.0.0.1:PORT]    # leader + standby with --redis
    FTHSDP_CHECKPOINT_URL=http://127.0.0.1:PORT
    FTHSDP_SHM_DIR=/dev/shm/fthsdp-up-...             # where ranks on this host publish snapshots
    FTHSDP_HEALTH=127.0.0.1:PORT                       # when the health service ran
    FTHSDP_HEALTH_URL=http://127.0.0.1:PORT
    FTHSDP_TOKEN_FILE=/abs/path/token

so replicas can be started against the stack (`set -a; . RUN_DIR/fthsdp.env; set +a`). The env
file exists exactly while the stack is up; `RUN_DIR/services.json` names every child's pid and
addresses. A child that dies is reported and restarted on the same ports (exponential backoff;
a crash loop stops the stack). SIGINT or SIGTERM stops every child, clients before the store; a
second SIGINT kills what is left at once.

`--redis` adds a local `redis-server` reached only through a unix socket in the run dir (mode
0700, no TCP port), so no password has to travel on a command line, and runs two quorum
instances on it (they elect a leader through a Redis lease; the other stands by); checkpoint and
health use the same Redis.

Security: the token lives in a file (generated, mode 0600, when none is given) and is never
printed; a Redis URL (`--redis-url` may hold a password) reaches the services in their
environment, never on a command line; services bind 127.0.0.1 unless `--host` says otherwise.

`deploy/up_plan.py` plans the children and the env file; this module runs them."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from fthsdp.deploy.failure_reporter import FailureReporter
from fthsdp.deploy.job import JobConfig, JobLauncher, job_summary, rank_env
from fthsdp.deploy.processes import (
    GaveUp,
    ManagedProcess,
    RestartPolicy,
    ServiceSpec,
    ServiceSupervisor,
)
from fthsdp.deploy.up_plan import Stack, UpConfig, plan_stack
from fthsdp.services.common.tokens import load_token

ENV_FILE_NAME = "fthsdp.env"
STATE_FILE_NAME = "services.json"
TOKEN_FILE_NAME = "token"  # noqa: S105 (a file name, not a secret)
_SAFE_ENV_VALUE = re.compile(r"^[A-Za-z0-9_./:,@%+=-]*$")


def ensure_token_file(config: UpConfig, run_dir: Path) -> tuple[Path, bool]:
    """The token file to use (absolute) and whether it was generated now.

    A given file must hold a valid token. Without one, RUN_DIR/token is reused or created with
    mode 0600 (replicas started against an earlier `up` keep working)."""
    if config.token_file is not None:
        path = config.token_file.resolve()
        load_token(path=str(path))  # raises ValueError/OSError with a clear message
        return path, False
    path = run_dir / TOKEN_FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        load_token(path=str(path))
        return path, False
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    return path, True


def render_env(env: dict[str, str], run_dir: Path) -> str:
    """The env file: `KEY=value` lines that both `set -a; . FILE` and `docker --env-file` read
    (values are quoted only when they must be, since docker keeps quotes literally)."""
    lines = [
        f"# fthsdp up: the control plane of {run_dir}; present while the stack runs.",
        f"# Load it with: set -a; . {shlex.quote(str(run_dir / ENV_FILE_NAME))}; set +a",
    ]
    for key, value in env.items():
        lines.append(f"{key}={value if _SAFE_ENV_VALUE.match(value) else shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


class _Signals:
    """SIGINT/SIGTERM → stop; a second SIGINT → force (kill what is left at once)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.force = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _: FrameType | None) -> None:
        if self.stop.is_set() and signum == signal.SIGINT:
            self.force = True
        self.stop.set()


def _state(
    stack: Stack,
    processes: Sequence[ManagedProcess],
    env_file: Path,
    job: JobLauncher | None = None,
) -> str:
    return json.dumps(
        {
            "up_pid": os.getpid(),
            "job": None if job is None else job.pids(),
            "env_file": str(env_file),
            "services": {
                p.name: {
                    "pid": p.pid,
                    "restarts": p.restarts,
                    "group": p.spec.group or p.name,
                    "addresses": dict(p.spec.addresses),
                    "log": str(p.spec.log_path),
                }
                for p in processes
            },
        },
        indent=2,
    )


def _stack_ready(processes: Sequence[ManagedProcess]) -> bool:
    """Every child live, and in each group (leader + standby) at least one ready."""
    groups: dict[str, list[ServiceSpec]] = {}
    for process in processes:
        groups.setdefault(process.spec.group or process.name, []).append(process.spec)
    return all(
        all(spec.live() for spec in members) and any(spec.ready() for spec in members)
        for members in groups.values()
    )


def _refuse_a_running_stack(state_file: Path) -> None:
    """Two launchers on one run dir would fight over its files: the second one stops here."""
    try:
        pid = int(json.loads(state_file.read_text())["up_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # left behind by a launcher that was killed
    except PermissionError:
        pass
    if pid != os.getpid():
        raise ValueError(f"fthsdp up (pid {pid}) already runs on {state_file.parent}")


def run_up(config: UpConfig, out: TextIO | None = None, job: JobConfig | None = None) -> int:
    """Runs the stack until SIGINT/SIGTERM (0) or a failure to start or a crash loop (1); with
    `job`, also the job's replicas (`deploy.job`), and the stack stops once the job finished (0)."""
    stream = out or sys.stdout

    def report(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} fthsdp up: {message}", file=stream, flush=True)

    run_dir = config.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    env_file = (config.env_file or run_dir / ENV_FILE_NAME).resolve()
    state_file = run_dir / STATE_FILE_NAME
    _refuse_a_running_stack(state_file)
    for stale in (env_file, state_file):
        stale.unlink(missing_ok=True)
    token_file, generated = ensure_token_file(config, run_dir)
    if generated:
        report(f"generated a token in {token_file} (mode 0600)")
    stack = plan_stack(config, token_file)
    signals = _Signals()
    signals.install()
    supervisor = ServiceSupervisor(
        stack.services,
        policy=RestartPolicy(max_failures_in_a_row=config.max_restarts),
        report=report,
        on_start=lambda _: write_state(),
    )
    launcher: JobLauncher | None = None
    reporter: FailureReporter | None = None

    def write_state() -> None:
        _write_atomic(state_file, _state(stack, supervisor.processes, env_file, launcher))

    def job_report(message: str) -> None:
        report(message)
        write_state()  # the job's pids changed

    code = 0
    try:
        supervisor.start_all()
        deadline = time.monotonic() + config.ready_timeout.total_seconds()
        supervisor.wait_ready(lambda: _stack_ready(supervisor.processes), deadline, signals.stop)
        if not signals.stop.is_set():
            _write_atomic(env_file, render_env(stack.env, run_dir))
            report("ready")
            for line in stack.summary:
                print(f"  {line}", file=stream)
            print(f"  env file    {env_file}", file=stream)
            if job is None:
                print(_replica_hint(env_file, stack.env), file=stream, flush=True)
                supervisor.supervise(signals.stop)
            else:
                for line in job_summary(job):
                    print(f"  {line}", file=stream, flush=True)
                launcher, reporter = _job_launcher(job, stack, run_dir, job_report)
                launcher.start_all()
                write_state()
                supervisor.supervise(signals.stop, until=launcher.poll)
                if not signals.stop.is_set():
                    report("the job finished")
    except (TimeoutError, RuntimeError, GaveUp) as exc:
        report(f"failed: {exc}")
        code = 1
    finally:
        report("stopping")
        if launcher is not None:
            launcher.stop_all(config.stop_grace.total_seconds())
        if reporter is not None:
            reporter.stop()
        env_file.unlink(missing_ok=True)
        supervisor.stop_all(config.stop_grace.total_seconds(), force=lambda: signals.force)
        signals.restore()
        state_file.unlink(missing_ok=True)
        for path in stack.cleanup:
            shutil.rmtree(path, ignore_errors=True)
        report("stopped")
    return code


def _job_launcher(
    job: JobConfig, stack: Stack, run_dir: Path, report: Callable[[str], None]
) -> tuple[JobLauncher, FailureReporter]:
    """The launcher of the job's replicas against the stack, and the child that reports failed
    ones to the quorum service (this process runs no gRPC: its children start with a pre-exec
    step)."""
    env = rank_env(stack.env)
    reporter = FailureReporter(env, run_dir / "logs" / "failure_reporter.log")
    launcher = JobLauncher(
        job, env, run_dir / "logs", failures=reporter, report=report, die_with_parent=True
    )
    return launcher, reporter


def replica_command(env: Mapping[str, str]) -> str:
    """The torchrun command `fthsdp up` suggests for one replica of the demo job, to run in a
    shell that loaded the env file whose variables are `env`: with the health service in the
    stack, its ranks send their telemetry (heartbeats, steps, collectives, digests) to it."""
    parts = [
        "torchrun --standalone --nproc-per-node W -m fthsdp.deploy.demo.train --run-dir runs/job",
        '--replica-id r0 --replica-index 0 --total-replicas R --quorum "$FTHSDP_QUORUM"',
        '--checkpoint-url "$FTHSDP_CHECKPOINT_URL" --shm-dir "$FTHSDP_SHM_DIR"',
    ]
    if "FTHSDP_HEALTH" in env:
        parts.append('--health "$FTHSDP_HEALTH"')
    return " \\\n    ".join(parts)


def _replica_hint(env_file: Path, env: Mapping[str, str]) -> str:
    return (
        "start a replica (W ranks) against it:\n"
        f"  set -a; . {shlex.quote(str(env_file))}; set +a\n"
        + textwrap.indent(replica_command(env), "  ")
    )
