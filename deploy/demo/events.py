"""The demo's run log: one typed event per JSON line, the writers' and the readers' one schema.

A run directory holds `replicas/<replica_id>.jsonl` (one per replica, appended by its leader across
restarts) and `supervisor.jsonl` (the launcher). Writers append events with `EventLog.write`
(one write per line); each event class names its `kind`, written as the line's `event`. The
writers are processes that get `kill -9`ed, so the readers expect damage: a last line cut short,
or a cut line with the next incarnation's first line glued onto it. Such a line is salvaged when
a whole event ends it and skipped (and counted) otherwise. Unknown events and unknown fields are
ignored, so a newer writer's lines still read; a known event with a wrongly typed field is a
writer bug and raises `ValueError` naming file and line.

`JsonlTail` reads incrementally (the live view polls it); `RunLog.load` reads a finished run."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True, slots=True)
class StartEvent:
    """A replica's leader began an incarnation."""

    kind: ClassVar[str] = "start"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str
    """Replica id."""
    step: int
    """The step it starts at."""
    pid: int = 0
    """The leader's process id."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitEvent:
    """A replica committed a step."""

    kind: ClassVar[str] = "commit"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str
    """The logging replica."""
    step: int
    """The committed step."""
    quorum_id: int
    """The quorum the step was committed in."""
    healthy: tuple[str, ...]
    """Replicas at max_step in that quorum."""
    recovered: bool
    """The logger caught up from peers in this step."""
    trained: Mapping[str, tuple[int, int]]
    """Per contributing replica, the [start, end) shard positions trained in this step."""
    loss: float | None
    """The logger's loss; None when it recovered in this step."""
    tokens: int
    """Tokens the logger trained in this step."""
    attempts: int
    """Exchange attempts before the commit."""
    seconds: Mapping[str, float]
    """Phase durations (quorum, ring, exchange, fetch, vote, commit, total)."""
    without_control_plane: bool = False
    """Committed on the previous plan while the quorum service was out of reach."""
    samples: tuple[int, ...] = ()
    """The leader's own micro-batch (dataset indices) fed in this step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FinalEvent:
    """A replica still alive at the end reported its state."""

    kind: ClassVar[str] = "final"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str
    """Replica id."""
    step: int
    """The step it stands at."""
    fingerprint: str
    """sha256 hex of parameter and optimizer bytes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunEvent:
    """The launcher's description of the run (first supervisor line)."""

    kind: ClassVar[str] = "run"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replicas: tuple[str, ...]
    """Replica ids."""
    world_size: int
    """Ranks per replica."""
    kill_every_s: float | None
    """Seconds between injected failures; None when none are injected."""
    kill_mode: str
    """Default failure kind."""
    seed: int
    """Model and data seed."""
    samples_per_step: int
    """Shard positions one replica trains per contributing step."""
    total_replicas: int
    """Shards of the data stream (replicas the job was configured with)."""
    min_replicas: int = 1
    """The smallest quorum the quorum service forms."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InjectEvent:
    """The launcher injected a failure."""

    kind: ClassVar[str] = "inject"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str | None
    """Victim; None when the control plane itself was the target (mode quorum)."""
    mode: str
    """process, replica, hang or quorum."""
    rank: int | None
    """Victim rank, None for the whole replica."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExitEvent:
    """A rank process ended."""

    kind: ClassVar[str] = "exit"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str
    """Its replica."""
    rank: int
    """Its rank."""
    code: int
    """Exit code; negative for a signal."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartEvent:
    """The launcher restarted a replica."""

    kind: ClassVar[str] = "restart"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str
    """Replica id."""
    spare: bool = False
    """Warm spares took over (else fresh processes started)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchEvent:
    """The launcher started a replica for the first time."""

    kind: ClassVar[str] = "launch"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str
    """Replica id."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuorumEvent:
    """The quorum service formed a new quorum."""

    kind: ClassVar[str] = "quorum"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    quorum_id: int
    """Monotonic epoch."""
    members: tuple[str, ...]
    """Replicas in the quorum."""
    healthy: tuple[str, ...]
    """Members at max_step."""
    max_step: int
    """Highest step among members."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RollbackEvent:
    """The whole job restarted from its last durable checkpoint (restart policy `job`): steps
    committed before it may be trained again, and the later commits are the history."""

    kind: ClassVar[str] = "rollback"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    replica: str | None = None
    """The replica whose failure caused it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EndEvent:
    """The launcher ended the run."""

    kind: ClassVar[str] = "end"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SparesEvent:
    """The launcher's pool of warm spares changed size."""

    kind: ClassVar[str] = "spares"

    t: float = field(default_factory=time.time)
    """Unix seconds (when written, by default)."""
    warm: int
    """Spares ready to take over."""


ReplicaEvent = StartEvent | CommitEvent | FinalEvent
SupervisorEvent = (
    RunEvent
    | InjectEvent
    | ExitEvent
    | LaunchEvent
    | RestartEvent
    | QuorumEvent
    | RollbackEvent
    | EndEvent
    | SparesEvent
)
Event = ReplicaEvent | SupervisorEvent

_MISSING: Any = object()


def _field(
    obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = _MISSING
) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING or (value is None and default is None):
        if default is _MISSING:
            raise ValueError(f"missing field {key!r}")
        return default
    # bool is an int subclass; a JSON true where a number belongs is a writer bug.
    if isinstance(value, bool) and kind is not bool:
        raise ValueError(f"field {key!r} must be {kind}, got bool")
    if not isinstance(value, kind):
        raise ValueError(f"field {key!r} must be {kind}, got {type(value).__name__}")
    return value


def _number(obj: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    value = _field(obj, key, (int, float), default)
    return value if value is None else float(value)


def _names(obj: Mapping[str, Any], key: str) -> tuple[str, ...]:
    values = _field(obj, key, list)
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"field {key!r} must be a list of strings")
    return tuple(values)


def _trained(obj: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for replica, span in _field(obj, "trained", dict).items():
        ok = isinstance(span, list) and len(span) == 2
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in span)
        if not ok or not 0 <= span[0] <= span[1]:
            raise ValueError(f"trained[{replica!r}] must be [start, end] with 0 <= start <= end")
        out[replica] = (span[0], span[1])
    return out


def _seconds(obj: Mapping[str, Any]) -> dict[str, float]:
    raw = _field(obj, "seconds", dict, {})
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in raw.values()):
        raise ValueError("field 'seconds' must map names to numbers")
    return {k: float(v) for k, v in raw.items()}


def _ints(obj: Mapping[str, Any], key: str) -> tuple[int, ...]:
    values = _field(obj, key, list, [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"field {key!r} must be a list of integers")
    return tuple(values)


def _start(obj: Mapping[str, Any], t: float) -> StartEvent:
    return StartEvent(
        t=t,
        replica=_field(obj, "replica", str),
        step=_field(obj, "step", int),
        pid=_field(obj, "pid", int, 0),
    )


def _commit(obj: Mapping[str, Any], t: float) -> CommitEvent:
    return CommitEvent(
        t=t,
        replica=_field(obj, "replica", str),
        step=_field(obj, "step", int),
        quorum_id=_field(obj, "quorum_id", int),
        healthy=_names(obj, "healthy"),
        recovered=_field(obj, "recovered", bool, False),
        trained=_trained(obj),
        loss=_number(obj, "loss", None),
        tokens=_field(obj, "tokens", int, 0),
        attempts=_field(obj, "attempts", int, 1),
        seconds=_seconds(obj),
        without_control_plane=_field(obj, "without_control_plane", bool, False),
        samples=_ints(obj, "samples"),
    )


def _final(obj: Mapping[str, Any], t: float) -> FinalEvent:
    return FinalEvent(
        t=t,
        replica=_field(obj, "replica", str),
        step=_field(obj, "step", int),
        fingerprint=_field(obj, "fingerprint", str),
    )


def _run(obj: Mapping[str, Any], t: float) -> RunEvent:
    replicas = _names(obj, "replicas")
    return RunEvent(
        t=t,
        replicas=replicas,
        world_size=_field(obj, "world_size", int, 1),
        kill_every_s=_number(obj, "kill_every_s", None),
        kill_mode=_field(obj, "kill_mode", str, "process"),
        seed=_field(obj, "seed", int, 0),
        samples_per_step=_field(obj, "samples_per_step", int, 0),
        total_replicas=_field(obj, "total_replicas", int, len(replicas)),
        min_replicas=_field(obj, "min_replicas", int, 1),
    )


def _inject(obj: Mapping[str, Any], t: float) -> InjectEvent:
    return InjectEvent(
        t=t,
        replica=_field(obj, "replica", str, None),
        mode=_field(obj, "mode", str),
        rank=_field(obj, "rank", int, None),
    )


def _exit(obj: Mapping[str, Any], t: float) -> ExitEvent:
    return ExitEvent(
        t=t,
        replica=_field(obj, "replica", str),
        rank=_field(obj, "rank", int, 0),
        code=_field(obj, "code", int, 0),
    )


def _quorum(obj: Mapping[str, Any], t: float) -> QuorumEvent:
    return QuorumEvent(
        t=t,
        quorum_id=_field(obj, "quorum_id", int),
        members=_names(obj, "members"),
        healthy=_names(obj, "healthy"),
        max_step=_field(obj, "max_step", int, 0),
    )


_PARSERS: Mapping[str, Callable[[Mapping[str, Any], float], Event]] = {
    StartEvent.kind: _start,
    CommitEvent.kind: _commit,
    FinalEvent.kind: _final,
    RunEvent.kind: _run,
    InjectEvent.kind: _inject,
    ExitEvent.kind: _exit,
    LaunchEvent.kind: lambda obj, t: LaunchEvent(t=t, replica=_field(obj, "replica", str)),
    RestartEvent.kind: lambda obj, t: RestartEvent(
        t=t, replica=_field(obj, "replica", str), spare=_field(obj, "spare", bool, False)
    ),
    QuorumEvent.kind: _quorum,
    RollbackEvent.kind: lambda obj, t: RollbackEvent(
        t=t, replica=_field(obj, "replica", str, None)
    ),
    EndEvent.kind: lambda obj, t: EndEvent(t=t),
    SparesEvent.kind: lambda obj, t: SparesEvent(t=t, warm=_field(obj, "warm", int)),
}
"""Each event kind's reader (every event class has one: a test writes each and reads it back)."""


def parse_event(obj: Mapping[str, Any]) -> Event | None:
    """The typed event of one decoded line; None for an event kind this reader does not know."""
    parse = _PARSERS.get(_field(obj, "event", str))
    return None if parse is None else parse(obj, _number(obj, "t"))


def to_json(event: Event) -> str:
    """One event as the JSON line `EventLog` writes (without its newline)."""
    return json.dumps({"event": event.kind, **dataclasses.asdict(event)})


class EventLog:
    """Appends one event per line, each with a single write, so a process killed mid-run leaves
    at most one torn last line (the readers tolerate it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, event: Event) -> None:
        self._file.write(to_json(event) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


_DECODER = json.JSONDecoder()


def _decode_line(line: str) -> dict[str, Any] | None:
    """The object on a line, or the whole object that ends a line whose start was cut off by a
    kill (the next incarnation appended after the fragment); None when nothing is recoverable."""
    try:
        obj = json.loads(line)
        return obj if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        pass
    end = len(line)
    # The leftmost '{' that decodes exactly to the end of the line is the outermost object; an
    # inner dict ("trained", "seconds") never reaches the end because its parent's '}' follows.
    for i in range(1, end):
        if line[i] != "{":
            continue
        try:
            obj, stop = _DECODER.raw_decode(line, i)
        except json.JSONDecodeError:
            continue
        if stop == end and isinstance(obj, dict) and "event" in obj:
            return obj
    return None


class JsonlTail:
    """Incremental reader of one append-only JSONL file: each `poll` reads only bytes appended
    since the last one and keeps an unterminated last line until its newline arrives."""

    def __init__(self, path: Path, *, strict: bool = True) -> None:
        self.path = path
        self.strict = strict
        """Raise on a known event with bad fields; otherwise record it in `skipped` (the live
        view must keep drawing whatever a writer does)."""
        self._offset = 0
        self._partial = b""
        self._lineno = 0
        self.skipped: list[str] = []
        """'file:line: reason' for every line that could not be read."""

    def skip_to_end(self) -> None:
        """Starts reading at the file's current end: only events appended from now on."""
        try:
            self._offset = self.path.stat().st_size
        except FileNotFoundError:
            self._offset = 0
        self._partial = b""

    def poll(self, *, final: bool = False) -> list[Event]:
        """Events completed since the last poll. With `final`, an unterminated last line is parsed
        too: the writer is gone, so no newline will ever come."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [e for e in (self._parse(raw) for raw in lines) if e is not None]

    def _parse(self, raw: bytes) -> Event | None:
        self._lineno += 1
        where = f"{self.path}:{self._lineno}"
        line = raw.decode("utf-8", errors="replace").strip()
        if not line:
            return None
        obj = _decode_line(line)
        if obj is None:
            self.skipped.append(f"{where}: unreadable line")
            return None
        try:
            return parse_event(obj)
        except ValueError as exc:
            if self.strict:
                raise ValueError(f"{where}: {exc}") from None
            self.skipped.append(f"{where}: {exc}")
            return None


def replica_log_paths(run_dir: Path) -> dict[str, Path]:
    """Replica id → its log file."""
    return {p.stem: p for p in sorted((run_dir / "replicas").glob("*.jsonl"))}


@dataclass(kw_only=True, slots=True)
class RunLog:
    """Everything a run directory recorded, in file order."""

    run: RunEvent | None = None
    """The launcher's first line, if written."""
    supervisor: list[SupervisorEvent] = field(default_factory=list)
    """ReplicaSupervisor events other than `run`."""
    replicas: dict[str, list[ReplicaEvent]] = field(default_factory=dict)
    """Replica id → its events."""
    skipped: list[str] = field(default_factory=list)
    """Lines that could not be read."""

    @classmethod
    def load(cls, run_dir: str | Path) -> RunLog:
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise ValueError(f"run directory {run_dir} does not exist")
        log = cls()
        sup = JsonlTail(run_dir / "supervisor.jsonl")
        log.add(sup.poll(final=True))
        log.skipped.extend(sup.skipped)
        for replica, path in replica_log_paths(run_dir).items():
            tail = JsonlTail(path)
            log.replicas.setdefault(replica, [])
            log.add(tail.poll(final=True))
            log.skipped.extend(tail.skipped)
        return log

    def add(self, events: Iterable[Event]) -> None:
        """Append events (the live view feeds polled events through here too)."""
        for event in events:
            if isinstance(event, RunEvent):
                self.run = event
            elif isinstance(event, StartEvent | CommitEvent | FinalEvent):
                self.replicas.setdefault(event.replica, []).append(event)
            else:
                self.supervisor.append(event)

    def replica_ids(self) -> list[str]:
        ids = set(self.replicas)
        if self.run is not None:
            ids.update(self.run.replicas)
        return sorted(ids)

    def commits(self, replica: str | None = None) -> list[CommitEvent]:
        """Commit lines of one replica, or of all replicas ordered by time."""
        sources = [replica] if replica is not None else list(self.replicas)
        out = [e for r in sources for e in self.replicas.get(r, []) if isinstance(e, CommitEvent)]
        return out if replica is not None else sorted(out, key=lambda e: e.t)

    def of_type(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.supervisor if isinstance(e, kind)]
