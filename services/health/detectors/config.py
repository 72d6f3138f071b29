"""Configuration of the health detectors (pure data; only `__main__` reads flags and env).

Durations are float seconds with an `_s` suffix rather than `timedelta`: the config travels as
JSON (`to_dict`/`from_dict`, the HTTP API can change it at run time) and every detector compares
them with float clocks, so one unit everywhere beats converting at each use."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

_RANGES: dict[str, tuple[float, float]] = {
    "heartbeat_timeout_s": (0.05, 3600.0),
    "hang_timeout_s": (0.1, 86400.0),
    "collective_retention_s": (1.0, 7 * 86400.0),
    "collective_groups_per_rank": (2, 1_000),
    "collective_groups_total": (1_000, 10_000_000),
    "slow_rank_window": (1, 10_000),
    "slow_rank_min_samples": (1, 10_000),
    "slow_rank_min_lag_s": (1e-4, 60.0),
    "fail_slow_warmup_steps": (4, 100_000),
    "fail_slow_margin": (1e-3, 100.0),
    "fail_slow_persist_steps": (1, 10_000),
    "fail_slow_persist_s": (0.0, 3600.0),
    "fail_slow_settle_s": (0.0, 3600.0),
    "fail_slow_cusum_slack": (0.0, 100.0),
    "fail_slow_cusum_threshold": (1e-3, 1e6),
    "slow_link_ratio": (1.5, 1e6),
    "slow_link_min_busy_s": (0.0, 3600.0),
    "sdc_min_replicas": (3, 100_000),
    "sdc_window_steps": (1, 100_000),
}
"""Bounds of every numeric setting (slow_rank_min_fraction has its own): settings sized far past
them (a 2**63 window) break the detectors' memory, far below them (a 1e-300 s timeout) turn
every rank into an incident."""

FailSlowPolicy = Literal["report", "evict"]
_POLICIES: tuple[str, ...] = ("report", "evict")


@dataclass(frozen=True, kw_only=True, slots=True)
class DetectorConfig:
    """How the detectors of one health service decide."""

    heartbeat_timeout_s: float = 1.0
    """A rank not heard from for this long is fail-stop (DESIGN: failure -> quorum <= 1 s)."""
    hang_timeout_s: float = 10.0
    """A collective open this long (since its first member entered) blocks the job: a hang.
    Far above a healthy collective's duration, far below the 60 s collective timeouts it beats."""
    collective_retention_s: float = 600.0
    """An open collective older than this is forgotten (a group of an old quorum that will never
    complete); bounds memory. Must exceed hang_timeout_s so a hang is reported first. A group
    that received no record for this long is forgotten with everything it holds, and so is a
    rank that is gone (fail-stop, or never heartbeating) and sent nothing for this long (or for
    heartbeat_timeout_s, if longer)."""
    collective_groups_per_rank: int = 64
    """The most collective groups tracked per rank. A rank is in a few at a time (its
    intra-replica group and one "ftar:<quorum_id>:<rank>" ring per quorum); past the bound its
    least recently recorded groups are forgotten (those of old quorums, dead anyway), so a long
    job never locks itself out and one report cannot make a rank hold thousands. A bound
    lowered at run time applies as ranks join groups."""
    collective_groups_total: int = 1_000_000
    """The most collective groups tracked in all (100K ranks in one ring each, with room for the
    rings of the quorums of the last collective_retention_s); past it the least recently recorded
    group is forgotten."""
    slow_rank_window: int = 40
    """K: how many of a group's most recent completed collectives the arrival analysis looks at."""
    slow_rank_min_samples: int = 20
    """A group needs this many completed collectives in its window before anyone is named."""
    slow_rank_min_fraction: float = 0.85
    """A rank is slow when it arrived last (by more than the minimum lag) in at least this
    fraction of the window."""
    slow_rank_min_lag_s: float = 0.03
    """Arriving last counts only when the last arriver waited this much less than the next one:
    below it, arrival order is jitter, not a straggler."""
    fail_slow_warmup_steps: int = 30
    """Steps per replica used to fit the predictor (and the baseline) before any detection."""
    fail_slow_margin: float = 0.25
    """An incident needs measured > predicted * (1 + margin), persistently (ResiHP's 25%)."""
    fail_slow_persist_steps: int = 5
    """How many of the most recent steps (median) must exceed the margin to confirm a change
    point; also the steps of recovery needed before the replica can be reported again."""
    fail_slow_persist_s: float = 2.0
    """...and those steps must span at least this long (more steps are taken until they do):
    five 10 ms steps are a blip (a page fault, a neighbour's burst), not a slow machine."""
    fail_slow_settle_s: float = 5.0
    """Fail-slow judges no step for this long after the job's membership changed (a fail-stop,
    a hang, a restart, a departure), nor while a replica is down or a rejoined one warms up:
    catch-up serving, ring rebuilds and (on shared hosts) restarts slow the others then."""
    fail_slow_cusum_slack: float = 0.1
    """CUSUM drift k on the relative residual: residuals below it never accumulate."""
    fail_slow_cusum_threshold: float = 1.0
    """CUSUM alarm threshold h on the accumulated relative residual (a change point)."""
    fail_slow_use_predictor: bool = True
    """False: the plain change-point detector on raw step time (the benchmark's baseline): every
    change point is an incident, with no workload model and no margin check."""
    fail_slow_policy: FailSlowPolicy = "report"
    """What a fail-slow incident asks for: "report" (tell the operator) or "evict" (the wire
    also reports the replica as failed to the quorum service). Written into the evidence."""
    slow_link_ratio: float = 4.0
    """A replica is behind slow links when both of its ring links (in and out) take this many
    times the time per byte of the links that do not touch it (`detectors.links`)."""
    slow_link_min_busy_s: float = 0.005
    """...and at least this long per exchange (median): below it, a healthy link's jitter."""
    sdc_min_replicas: int = 3
    """Fingerprints of a step are judged only once this many replicas reported it: with two, a
    disagreement has no majority, so neither can be named."""
    sdc_window_steps: int = 64
    """Fingerprints are kept for this many most recent steps (bounds memory)."""

    def __post_init__(self) -> None:
        for name, (low, high) in _RANGES.items():
            value = getattr(self, name)
            if not (isinstance(value, int | float) and low <= value <= high):
                raise ValueError(f"{name} must be in {low:g}..{high:g}, got {value!r}")
        for name in ("heartbeat_timeout_s", "hang_timeout_s", "collective_retention_s"):
            _positive(name, getattr(self, name))
        if self.collective_retention_s <= self.hang_timeout_s:
            raise ValueError("collective_retention_s must exceed hang_timeout_s")
        if self.collective_groups_per_rank > self.collective_groups_total:
            raise ValueError("collective_groups_per_rank must not exceed collective_groups_total")
        for name in ("slow_rank_window", "slow_rank_min_samples", "fail_slow_warmup_steps"):
            _at_least(name, getattr(self, name), 1)
        _at_least("fail_slow_persist_steps", self.fail_slow_persist_steps, 1)
        if self.slow_rank_min_samples > self.slow_rank_window:
            raise ValueError("slow_rank_min_samples must not exceed slow_rank_window")
        if not 0.5 < self.slow_rank_min_fraction <= 1.0:
            raise ValueError("slow_rank_min_fraction must be in (0.5, 1]")
        if self.fail_slow_warmup_steps < 4:
            raise ValueError("fail_slow_warmup_steps must be >= 4 (3 coefficients to fit)")
        for name in ("slow_rank_min_lag_s", "fail_slow_margin", "fail_slow_cusum_threshold"):
            _positive(name, getattr(self, name))
        if not 0.0 <= self.fail_slow_cusum_slack < math.inf:
            raise ValueError("fail_slow_cusum_slack must be finite and >= 0")
        if self.fail_slow_policy not in _POLICIES:
            raise ValueError(f"fail_slow_policy must be one of {_POLICIES}")
        _at_least("sdc_min_replicas", self.sdc_min_replicas, 3)
        _at_least("sdc_window_steps", self.sdc_window_steps, 1)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, JSON-ready."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DetectorConfig:
        """The config from (a subset of) `to_dict`'s keys; missing keys keep their defaults.

        Raises ValueError on an unknown key, a value of the wrong type (bool is not a number,
        an int is accepted for a float) or a value `__post_init__` rejects."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown detector settings: {', '.join(unknown)}")
        defaults = cls()
        values: dict[str, Any] = {}
        for name, value in data.items():
            values[name] = _coerce(name, value, getattr(defaults, name))
        return cls(**values)


def _coerce(name: str, value: Any, default: Any) -> Any:
    """`value` checked against the type of the field's default."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a boolean, got {value!r}")
        return value
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if isinstance(default, int):
        if not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
