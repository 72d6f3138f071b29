"""Where data positions live: a Protocol, an in-memory adapter and an fsync'd JSONL file adapter.

The Redis adapter (`store_redis.py`) shares positions between the sidecars of a job; the
sidecar defaults to files under its durable root, so positions survive its restart."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Protocol

from fthsdp.services.checkpoint.client_errors import InvalidArgumentError
from fthsdp.services.checkpoint.client_manifest import check_id, check_step
from fthsdp.services.checkpoint.core import PositionRecord, PositionTimeline, check_position

log = logging.getLogger(__name__)


class PositionStore(Protocol):
    """Durable data-position records per (job, replica); see core.PositionTimeline for semantics."""

    def append(self, job: str, replica: str, record: PositionRecord) -> None:
        """Records `record`; returns only once it is durable."""
        ...

    def at(self, job: str, replica: str, step: int | None) -> PositionRecord | None:
        """The record with the greatest step ≤ `step` (the newest when None), or None."""
        ...

    def close(self) -> None: ...


class MemoryPositionStore:
    """Positions in process memory: for tests and single-process demos (lost on restart)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timelines: dict[tuple[str, str], PositionTimeline] = {}

    def append(self, job: str, replica: str, record: PositionRecord) -> None:
        with self._lock:
            self._timelines.setdefault((job, replica), PositionTimeline()).apply(record)

    def at(self, job: str, replica: str, step: int | None) -> PositionRecord | None:
        with self._lock:
            timeline = self._timelines.get((job, replica))
            return None if timeline is None else timeline.at(step)

    def close(self) -> None:
        pass


class FilePositionStore:
    """One append-only JSONL file per (job, replica) under `root`, flushed and fsync'd per record.

    The file is replayed into a timeline on first use; a torn last line (a crash mid-append) is
    skipped with a warning, since its append never returned to the caller."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._timelines: dict[tuple[str, str], PositionTimeline] = {}

    def _path(self, job: str, replica: str) -> Path:
        return self.root / check_id("job", job) / f"{check_id('replica', replica)}.jsonl"

    def _timeline(self, job: str, replica: str) -> PositionTimeline:
        key = (job, replica)
        timeline = self._timelines.get(key)
        if timeline is None:
            timeline = PositionTimeline()
            path = self._path(job, replica)
            if path.exists():
                last = b"\n"
                with path.open("rb") as f:
                    for number, line in enumerate(f, 1):
                        last = line[-1:]
                        record = _parse_line(line)
                        if record is None:
                            log.warning("skipping unreadable line %d of %s", number, path)
                        else:
                            timeline.apply(record)
                if last != b"\n":  # a torn last line: end it, so the next record stays whole
                    _append(path, b"\n")
            self._timelines[key] = timeline
        return timeline

    def append(self, job: str, replica: str, record: PositionRecord) -> None:
        line = json.dumps({"step": record.step, "position": record.position}) + "\n"
        with self._lock:
            timeline = self._timeline(job, replica)
            path = self._path(job, replica)
            created = not path.parent.exists()
            path.parent.mkdir(parents=True, exist_ok=True)
            _append(path, line.encode())
            if created:
                _fsync_dir(path.parent)
            timeline.apply(record)

    def at(self, job: str, replica: str, step: int | None) -> PositionRecord | None:
        with self._lock:
            return self._timeline(job, replica).at(step)

    def close(self) -> None:
        with self._lock:
            self._timelines.clear()


def _parse_line(line: bytes) -> PositionRecord | None:
    try:
        raw = json.loads(line)
        return PositionRecord(check_step(raw["step"]), check_position(raw["position"]))
    except (ValueError, KeyError, TypeError, InvalidArgumentError):
        return None


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
