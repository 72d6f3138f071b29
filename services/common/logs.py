"""One logging setup for every fthsdp process: a single handler on the root logger that prints
the context code passes in `extra={...}` (replica, step, cause, ...), which the stock formats drop.

Two formats:
- `text` (default): `<time> <LEVEL> <logger>: <message> key=value ...`; a value with spaces, quotes
  or `=` in it is written as a JSON string, so a line still splits on spaces into its fields.
- `json`: one object per line with `ts` (ISO 8601, UTC), `level`, `logger`, `msg`, the context
  fields, and `exc` (the formatted traceback) when there is one. A context value JSON cannot
  encode is written as its `str()`.

The context fields of a record are its attributes that a blank `LogRecord` does not have."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TextIO

FORMATS = ("text", "json")
"""What `configure` accepts as `fmt`."""

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    # Not context: set by Formatter.format, or by newer Pythons (taskName, 3.12)...
    "message",
    "asctime",
    "taskName",
    # uvicorn's copy of its message with terminal colour codes, for its own formatter.
    "color_message",
}
_FIXED_JSON = ("ts", "level", "logger", "msg", "exc", "stack")
"""Keys of a JSON line that a context field of the same name cannot replace."""
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def context(record: logging.LogRecord) -> dict[str, Any]:
    """The record's `extra` fields (and those a context filter added), in the order set."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _text_value(value: Any) -> str:
    text = str(value)
    if text == "" or any(c.isspace() or c in "\"'=" for c in text):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    """`<time> <LEVEL> <logger>: <message> key=value ...`, then the traceback on its own lines."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = context(record)
        if not fields:
            return line
        return line + "".join(f" {k}={_text_value(v)}" for k, v in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback's newlines are escaped in `exc`)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in context(record).items():
            line[f"extra_{key}" if key in _FIXED_JSON else key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


class _ContextFilter(logging.Filter):
    """Stamps fixed fields (a rank process's replica and rank) on records that lack them."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        super().__init__()
        self.fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class _Handler(logging.StreamHandler[TextIO]):
    """The one handler `configure` owns (found again by its type, so a second call reuses it)."""


def parse_level(level: str) -> int:
    """`"info"` / `"INFO"` / `"20"` -> 20; ValueError for anything else."""
    text = level.strip().upper()
    if text.isdigit():
        return int(text)
    value = logging.getLevelNamesMapping().get(text)
    if value is None:
        raise ValueError(f"unknown log level {level!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return value


def configure(
    level: str = "INFO",
    fmt: str = "text",
    *,
    stream: TextIO | None = None,
    fields: Mapping[str, Any] | None = None,
) -> None:
    """Points the root logger at one handler writing `fmt` lines to `stream` (default stderr)
    at `level`. Calling it again replaces that handler's settings instead of adding a second
    one; handlers others installed (pytest's capture) are left alone. `fields` are stamped on
    every record that lacks them. ValueError for an unknown level or format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (one of {', '.join(FORMATS)})")
    numeric = parse_level(level)
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _Handler)), None)
    if handler is None:
        handler = _Handler(stream or sys.stderr)
        root.addHandler(handler)
    elif getattr(handler.stream, "closed", False):
        # setStream flushes the old stream first, which raises on a closed one (a test's
        # captured stderr, a redirect that has ended): nothing is left to flush there.
        handler.stream = stream or sys.stderr
    else:
        handler.setStream(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    for old in [f for f in handler.filters if isinstance(f, _ContextFilter)]:
        handler.removeFilter(old)
    if fields:
        handler.addFilter(_ContextFilter(fields))
    root.setLevel(numeric)
