"""Supervised child processes for `fthsdp up`: start, probe, restart with backoff, stop in tiers.

Each child runs in its own session, so a terminal's Ctrl-C reaches only the launcher, which then
stops the children in order (clients of a store before the store) instead of all at once. On
Linux a child also gets SIGTERM when the launcher dies without cleaning up (even by SIGKILL), so
nothing is left listening on the ports.

The supervisor is a polling loop on the launcher's main thread: signal handlers run between its
short waits, and no thread races another over a child's state."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A preexec function asking Linux to SIGTERM the child when `parent` dies."""
    if not sys.platform.startswith("linux"):
        return None

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` for a child to bind (with SO_REUSEADDR, as every server here
    does) in the next minute.

    A port the kernel merely reported free is handed out again: to the next `bind(host, 0)`
    (this launcher's next call, another process's) and as the source port of any outgoing
    connection, before the child got to bind it; the child then fails to start. So the port is
    left reserved instead: a connection to it is accepted and closed from the accepting side,
    which parks (host, port) in TIME_WAIT for the kernel's 60 s. Meanwhile the kernel picks it
    neither for `bind(0)` nor for a `connect()`, while a listener with SO_REUSEADDR may bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        # Inherited by the accepted socket, hence by its TIME_WAIT: what lets the child's
        # SO_REUSEADDR bind through it.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(1)
        address = listener.getsockname()
        with socket.socket(family, socket.SOCK_STREAM) as client:
            client.connect(address)
            accepted, _ = listener.accept()
            accepted.close()  # the accepting side closes first: its end goes to TIME_WAIT
        return int(address[1])


def describe_exit(code: int) -> str:
    """`exit code 3` or `killed by SIGKILL` for a Popen return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def kill_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL to every running process; every one is reaped before this returns."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def terminate_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGCONT + SIGTERM to every running process (a stopped one could not act on it), SIGKILL
    to those still running after `grace_s`; every one is reaped before this returns."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass(kw_only=True, slots=True)
class ServiceSpec:
    """How to run, probe and stop one child."""

    name: str
    """Unique name, used in messages, the log file name and the state file."""
    argv: Sequence[str]
    """The command line. Never a secret: tokens and passwords travel in files or `env`."""
    log_path: Path
    """stdout and stderr of every incarnation are appended here."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added to the launcher's environment."""
    live: Callable[[], bool] = lambda: True
    """Whether the running child answers its liveness probe."""
    ready: Callable[[], bool] = lambda: True
    """Whether the running child is ready to serve."""
    group: str = ""
    """Interchangeable instances share a group (leader + standby): the stack is ready when each
    is live and one of them is ready. Empty: a group of its own."""
    tier: int = 1
    """Shutdown order: higher tiers stop first (a store is tier 0, its clients tier 1)."""
    addresses: Mapping[str, str] = field(default_factory=dict)
    """What the child serves on, reported in the state file."""
    die_with_parent: bool = True
    """Ask Linux to SIGTERM the child when the launcher dies. This runs code between fork and
    exec, which is unsafe in a launcher that itself runs gRPC threads (the demo embeds the
    quorum service): such a launcher stops its children itself and passes False."""


class ManagedProcess:
    """One child process and its incarnations."""

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        """How many times the child was started again after it died."""
        self.failures_in_a_row = 0
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.awaiting_ready = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        with self.spec.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                list(self.spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()) if self.spec.die_with_parent else None,
            )
        self.started_at = time.monotonic()
        self.restart_at = None

    def poll(self) -> int | None:
        """The exit code once the current incarnation has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        """Sends `signum` to the child's process group (the child and anything it forked)."""
        if self.running() and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)


@dataclass(kw_only=True, slots=True)
class RestartPolicy:
    """When a dead child is started again."""

    first_delay_s: float = 0.2
    """Wait before the first restart; doubles for each failure in a row."""
    max_delay_s: float = 5.0
    """Longest wait between restarts."""
    stable_after_s: float = 30.0
    """A child that ran this long before dying starts a fresh count of failures in a row."""
    max_failures_in_a_row: int = 10
    """Past this many failures in a row the launcher gives up (a crash loop: bad flags, a port
    taken); 0 means never restart."""

    def count_failure(self, failures_in_a_row: int, ran_s: float) -> int:
        """Failures in a row once a child that ran `ran_s` died; past `max_failures_in_a_row`
        the launcher gives up."""
        return (0 if ran_s >= self.stable_after_s else failures_in_a_row) + 1

    def delay(self, failures_in_a_row: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** max(0, failures_in_a_row - 1))


class GaveUp(RuntimeError):
    """A child kept dying: the launcher stops everything rather than loop forever."""


class ServiceSupervisor:
    """Starts children in order, keeps them running, stops them in tiers."""

    def __init__(
        self,
        services: Sequence[ServiceSpec],
        *,
        policy: RestartPolicy,
        report: Callable[[str], None],
        on_start: Callable[[ManagedProcess], None] = lambda _: None,
        poll_interval_s: float = 0.1,
    ) -> None:
        names = [s.name for s in services]
        if len(set(names)) != len(names):
            raise ValueError(f"service names must be unique: {names}")
        self.processes = [ManagedProcess(spec) for spec in services]
        self._policy = policy
        self._report = report
        self._on_start = on_start
        self._poll = poll_interval_s

    def start_all(self) -> None:
        for process in self.processes:
            process.start()
            self._on_start(process)

    def wait_ready(self, ready: Callable[[], bool], deadline: float, stop: threading.Event) -> None:
        """Polls `ready` until it holds; raises TimeoutError at `deadline`, or RuntimeError when
        a child exits while the stack starts (its log says why)."""
        while not stop.is_set():
            for process in self.processes:
                code = process.poll()
                if code is not None:
                    raise RuntimeError(
                        f"{process.name} exited while starting ({describe_exit(code)}); "
                        f"see {process.spec.log_path}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the stack was not ready in time")
            stop.wait(self._poll)

    def supervise(
        self, stop: threading.Event, until: Callable[[float], bool] | None = None
    ) -> None:
        """Restarts dead children until `stop` is set or `until(now)`, asked every round after
        the children's, says so; raises GaveUp on a crash loop."""
        while not stop.is_set():
            now = time.monotonic()
            self.tick(now)
            if until is not None and until(now):
                return
            stop.wait(self._poll)

    def tick(self, now: float) -> None:
        """One round: notice deaths, restart those whose backoff expired, report recoveries."""
        for process in self.processes:
            if process.restart_at is not None:
                if now >= process.restart_at:
                    process.start()
                    process.restarts += 1
                    process.awaiting_ready = True
                    self._on_start(process)
                    self._report(f"{process.name} restarted (pid {process.pid})")
                continue
            code = process.poll()
            if code is None:
                if process.awaiting_ready and process.spec.ready():
                    process.awaiting_ready = False
                    self._report(f"{process.name} is ready again")
                continue
            self._schedule_restart(process, code, now)

    def _schedule_restart(self, process: ManagedProcess, code: int, now: float) -> None:
        process.failures_in_a_row = self._policy.count_failure(
            process.failures_in_a_row, now - process.started_at
        )
        if process.failures_in_a_row > self._policy.max_failures_in_a_row:
            raise GaveUp(
                f"{process.name} exited ({describe_exit(code)}) {process.failures_in_a_row} "
                f"times in a row; giving up (see {process.spec.log_path})"
            )
        delay = self._policy.delay(process.failures_in_a_row)
        process.restart_at = now + delay
        self._report(
            f"{process.name} (pid {process.pid}) exited: {describe_exit(code)}; "
            f"restarting in {delay:.1f} s"
        )

    def stop_all(self, grace_s: float, force: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM by tier, highest first; SIGKILL what is still running after `grace_s` per
        tier, or at once when `force()` turns true (a second Ctrl-C)."""
        for process in self.processes:
            process.restart_at = None
        for tier in sorted({p.spec.tier for p in self.processes}, reverse=True):
            members = [p for p in self.processes if p.spec.tier == tier and p.running()]
            for process in members:
                process.signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while any(p.running() for p in members):
                if force() or time.monotonic() > deadline:
                    for process in members:
                        if process.running():
                            self._report(f"{process.name} did not stop in time: SIGKILL")
                            process.signal(signal.SIGKILL)
                    break
                time.sleep(0.05)
            for process in members:
                if process.proc is not None:
                    process.proc.wait()
