"""The demo's JSON-lines logs (the format `deploy.demo.report` reads)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends one JSON object per line, each with a single write, so a process killed mid-run
    leaves at most one torn last line (the reader tolerates it)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        self._file.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
