"""The live terminal view of a demo run, drawn from the run directory's logs alone.

Each refresh reads only what was appended since the last one (`JsonlTail` keeps file offsets), so
the cost stays flat however long the run gets. States are derived from the logs:
- down: the supervisor logged an `exit` or `inject` for the replica after its latest `start`;
- recovering: its latest commit caught up from peers, or it started and has not committed yet;
- healthy: otherwise;
- starting: nothing logged yet; finished: its latest incarnation wrote its `final` line (so the
  launcher stopping it at the end is not shown as a failure)."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fthsdp.deploy.demo.events import (
    CommitEvent,
    Event,
    ExitEvent,
    FinalEvent,
    InjectEvent,
    JsonlTail,
    QuorumEvent,
    RestartEvent,
    RunEvent,
    SparesEvent,
    StartEvent,
)

_RATE_WINDOW = 5
"""Commits the tokens/s estimate spans: recent enough to show a stall, long enough to be smooth."""
_STATE_STYLES = {
    "healthy": "green",
    "recovering": "yellow",
    "down": "bold red",
    "starting": "dim",
    "finished": "cyan",
}


@dataclass(slots=True)
class _ReplicaState:
    step: int | None = None
    last_start: float | None = None
    last_down: float | None = None
    last_final: float | None = None
    last_commit: CommitEvent | None = None
    loss: float | None = None
    restarts: int = 0
    """Times the launcher started the replica again."""
    recent: deque[CommitEvent] = field(default_factory=lambda: deque(maxlen=_RATE_WINDOW))

    @property
    def state(self) -> str:
        if self.last_final is not None and (
            self.last_start is None or self.last_final > self.last_start
        ):
            return "finished"
        if self.last_down is not None and (
            self.last_start is None or self.last_down > self.last_start
        ):
            return "down"
        if self.last_start is None and self.last_commit is None:
            return "starting"
        started_since_commit = self.last_start is not None and (
            self.last_commit is None or self.last_commit.t < self.last_start
        )
        if started_since_commit or (self.last_commit is not None and self.last_commit.recovered):
            return "recovering"
        return "healthy"

    def tokens_per_s(self) -> float | None:
        if len(self.recent) < 2:
            return None
        span = self.recent[-1].t - self.recent[0].t
        # The first commit of the window only marks its start; its tokens predate the span.
        tokens = sum(c.tokens for c in list(self.recent)[1:])
        return tokens / span if span > 0 else None


class LiveView:
    """Per-replica step, state, quorum, loss and throughput, plus a run status line."""

    def __init__(self, run_dir: str | Path, replicas: list[str]) -> None:
        self.run_dir = Path(run_dir)
        self._states = {r: _ReplicaState() for r in replicas}
        self._supervisor = JsonlTail(self.run_dir / "supervisor.jsonl", strict=False)
        self._tails: dict[str, JsonlTail] = {}
        self._started: float | None = None
        self._injected = 0
        self._quorum: QuorumEvent | None = None
        self._spares: int | None = None
        """Warm spares ready (None: the run keeps no pool)."""

    def poll(self) -> None:
        """Read what the logs gained since the last poll."""
        for replica in self._states:
            if replica not in self._tails:
                path = self.run_dir / "replicas" / f"{replica}.jsonl"
                self._tails[replica] = JsonlTail(path, strict=False)
            for event in self._tails[replica].poll():
                self._apply(event)
        for event in self._supervisor.poll():
            self._apply(event)

    def _apply(self, event: Event) -> None:
        if isinstance(event, RunEvent):
            self._started = event.t
            return
        if isinstance(event, QuorumEvent):
            self._quorum = event
            return
        if isinstance(event, SparesEvent):
            self._spares = event.warm
            return
        if self._started is None:
            self._started = event.t
        replica = getattr(event, "replica", None)
        if isinstance(event, InjectEvent):
            self._injected += 1
        state = self._states.get(replica) if isinstance(replica, str) else None
        if state is None:
            return
        if isinstance(event, StartEvent):
            state.last_start, state.step = event.t, event.step
            # A new incarnation's figures start afresh: the old loss and rate describe a process
            # that no longer exists.
            state.loss, state.last_commit = None, None
            state.recent.clear()
        elif isinstance(event, InjectEvent | ExitEvent):
            state.last_down = max(state.last_down or event.t, event.t)
        elif isinstance(event, CommitEvent):
            state.last_commit, state.step = event, event.step + 1
            state.recent.append(event)
            if event.loss is not None:
                state.loss = event.loss
        elif isinstance(event, FinalEvent):
            state.last_final, state.step = event.t, event.step
        elif isinstance(event, RestartEvent):
            state.restarts += 1

    def status_line(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        elapsed = 0.0 if self._started is None else max(0.0, now - self._started)
        q = self._quorum
        quorum = (
            "none yet"
            if q is None
            else f"#{q.quorum_id} healthy {','.join(q.healthy) or '-'} max_step {q.max_step}"
        )
        spares = "" if self._spares is None else f" | spares {self._spares}"
        return (
            f"elapsed {elapsed:6.1f}s | failures injected {self._injected} | quorum {quorum}"
            f"{spares}"
        )

    def render(self, now: float | None = None) -> Group:
        """Poll the logs and draw the table with the status line under it."""
        self.poll()
        table = Table(title="fthsdp demo", expand=False)
        for column in ("replica", "step", "state", "quorum", "loss", "tokens/s"):
            table.add_column(column, justify="left" if column in ("replica", "state") else "right")
        for replica, s in self._states.items():
            state = s.state
            rate = s.tokens_per_s()
            table.add_row(
                replica,
                "-" if s.step is None else str(s.step),
                Text(state, style=_STATE_STYLES[state]),
                "-" if s.last_commit is None else str(s.last_commit.quorum_id),
                "-" if s.loss is None else f"{s.loss:.3f}",
                "-" if rate is None else f"{rate:,.0f}",
            )
        return Group(table, Text(self.status_line(now)))

    def plain_line(self, now: float | None = None) -> str:
        """One line for logs and pipes: every replica's step and state, then the status."""
        self.poll()
        parts = [
            f"{r} {s.step if s.step is not None else '-'} {s.state}"
            for r, s in self._states.items()
        ]
        return " | ".join([*parts, self.status_line(now)])

    def progress_lines(self) -> list[str]:
        """One `key=value` line per replica (`fthsdp demo --no-live`): step, loss, state and
        restarts so far, the figures of the live view's table."""
        self.poll()
        return [progress_line(r, s) for r, s in self._states.items()]


def progress_line(replica: str, state: _ReplicaState) -> str:
    """`progress replica=r0 step=12 loss=2.345 state=healthy restarts=1` (`-`: not known yet)."""
    step = "-" if state.step is None else str(state.step)
    loss = "-" if state.loss is None else f"{state.loss:.3f}"
    return (
        f"progress replica={replica} step={step} loss={loss} state={state.state} "
        f"restarts={state.restarts}"
    )


def run_progress(
    view: LiveView, stop_event: threading.Event, every_s: float = 10.0, *, out: TextIO | None = None
) -> None:
    """Prints `view.progress_lines()` every `every_s` until `stop_event` is set: the view's data
    as plain lines, for runs whose output goes to a file or a CI log (`--no-live`)."""
    if every_s <= 0:
        raise ValueError("every_s must be positive")
    while True:
        lines = view.progress_lines()
        print("\n".join(lines), file=out or sys.stdout, flush=True)
        if stop_event.wait(every_s):
            return


def run_live(
    view: LiveView,
    stop_event: threading.Event,
    refresh_s: float = 0.5,
    *,
    console: Console | None = None,
    plain_every_s: float = 5.0,
) -> None:
    """Redraw `view` until `stop_event` is set. On a terminal the table updates in place; on a pipe
    one plain status line is printed every `plain_every_s`, so CI logs stay readable."""
    if refresh_s <= 0 or plain_every_s <= 0:
        raise ValueError("refresh_s and plain_every_s must be positive")
    console = console or Console(file=sys.stdout)
    if not console.is_terminal:
        while True:
            console.print(view.plain_line(), markup=False, highlight=False, soft_wrap=True)
            if stop_event.wait(plain_every_s):
                return
    with Live(view.render(), console=console, auto_refresh=False, transient=False) as live:
        while not stop_event.wait(refresh_s):
            live.update(view.render(), refresh=True)
        live.update(view.render(), refresh=True)
