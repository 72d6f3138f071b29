"""Pure decisions of the checkpoint service: ranges, retention, restore choice, position timelines.

No I/O, no clock, no framework imports: every function is a function of its arguments, so the
unit tests cover the policy without servers or files."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fthsdp.services.checkpoint.client_errors import InvalidArgumentError, RangeNotSatisfiableError
from fthsdp.services.checkpoint.client_manifest import INT64_MAX, INT64_MIN

MAX_POSITION_KEYS = 64
MAX_POSITION_KEY_CHARS = 128
_RANGE = re.compile(r"^bytes=(\d{1,19})-(\d{0,19})$")
_STEP_DIR = re.compile(r"^step-(\d{12,19})$")
_RANK_DIR = re.compile(r"^rank-(\d{1,7})$")


def parse_range(header: str | None, total: int, max_bytes: int) -> tuple[int, int]:
    """The [start, stop) a `Range` header asks for: one `bytes=a-b` or `bytes=a-` range.

    No header means the whole object, allowed only up to `max_bytes`. A range past the end or
    larger than `max_bytes` raises RangeNotSatisfiableError; anything else InvalidArgumentError."""
    if header is None:
        if total > max_bytes:
            raise RangeNotSatisfiableError(
                f"object of {total} bytes exceeds {max_bytes} per request: send a Range header"
            )
        return 0, total
    match = _RANGE.match(header.strip())
    if match is None:
        raise InvalidArgumentError("Range must be a single 'bytes=start-end' range")
    start = int(match.group(1))
    stop = total if not match.group(2) else min(int(match.group(2)) + 1, total)
    if start >= total or stop <= start:
        raise RangeNotSatisfiableError(f"range {header!r} is outside 0..{total}")
    if stop - start > max_bytes:
        raise RangeNotSatisfiableError(
            f"range of {stop - start} bytes exceeds the limit of {max_bytes} per request"
        )
    return start, stop


def steps_to_collect(steps: Iterable[int], retain: int) -> list[int]:
    """All but the newest `retain` steps, oldest first."""
    ordered = sorted(steps)
    return ordered[: max(len(ordered) - retain, 0)]


def checkpoint_steps_to_delete(complete: Mapping[int, bool], retain: int) -> tuple[list[int], str]:
    """Durable steps to delete given {step: complete}: complete ones beyond the newest `retain`,
    and incomplete ones older than the oldest kept complete step (abandoned partials)."""
    done = sorted((s for s, ok in complete.items() if ok), reverse=True)
    if not done:
        return [], "no complete step yet"
    kept = done[:retain]
    oldest_kept = kept[-1]
    doomed = sorted(s for s in complete if s < oldest_kept)
    return doomed, f"keeping complete steps {sorted(kept)}"


def choose_latest(candidates: Iterable[tuple[int, str | None]]) -> tuple[int | None, str]:
    """The newest step whose verification failure is None, and why newer ones were skipped."""
    skipped: list[str] = []
    for step, failure in sorted(candidates, key=lambda c: c[0], reverse=True):
        if failure is None:
            why = f"step {step}" + (f", skipped {'; '.join(skipped)}" if skipped else "")
            return step, why
        skipped.append(f"step {step}: {failure}")
    return None, "no complete step" + (f" ({'; '.join(skipped)})" if skipped else "")


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank}"


def parse_rank_dir(name: str) -> int | None:
    match = _RANK_DIR.match(name)
    return int(match.group(1)) if match else None


def check_position(raw: Any) -> dict[str, int]:
    """A bounded copy of a data position: ≤64 string keys with int64 values."""
    if not isinstance(raw, Mapping) or len(raw) > MAX_POSITION_KEYS:
        raise InvalidArgumentError(
            f"position must be an object of at most {MAX_POSITION_KEYS} keys"
        )
    out: dict[str, int] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_POSITION_KEY_CHARS:
            raise InvalidArgumentError(f"position keys must be 1..{MAX_POSITION_KEY_CHARS} chars")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"position value of {key!r} must be an integer")
        if not INT64_MIN <= value <= INT64_MAX:
            raise InvalidArgumentError(f"position value of {key!r} is outside int64")
        out[key] = value
    return out


@dataclass(frozen=True, slots=True)
class PositionRecord:
    """A replica's data position as committed with `step`."""

    step: int
    position: dict[str, int]


class PositionTimeline:
    """The records of one (job, replica) in commit order, as a timeline.

    A record for step s supersedes every record with step ≥ s: a replica that rewinds (restored
    from an older checkpoint) abandons the future it had recorded, so `at(n)` never answers with a
    position from a timeline that no longer exists — which is what exactly-once data needs."""

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._records: list[PositionRecord] = []

    def __len__(self) -> int:
        return len(self._steps)

    def apply(self, record: PositionRecord) -> None:
        cut = bisect.bisect_left(self._steps, record.step)
        del self._steps[cut:]
        del self._records[cut:]
        self._steps.append(record.step)
        self._records.append(record)

    def at(self, step: int | None) -> PositionRecord | None:
        """The record with the greatest step ≤ `step` (the newest when None)."""
        index = len(self._steps) if step is None else bisect.bisect_right(self._steps, step)
        return self._records[index - 1] if index else None
