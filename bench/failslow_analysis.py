"""What `bench.failslow` reads from a run directory's commit lines (`replicas/<r>.jsonl`, through
`deploy.demo.events`) once a demo is done, and how it compares the policies: pure functions of
the logs, the schedule as it ran and the `fthsdp status` documents polled meanwhile.

- Job samples/s: each committed step counted once, at its first commit line in any replica's
  log, with the samples of every contributor (the sum of its `trained` ranges); over a window,
  the samples of the steps first committed in it / the window's length. Each measured segment is
  cut into `--windows` windows; the figure is their median.
- A replica's own speed: samples it trained per second of its own compute, from its leader's
  consecutive commits: the commit interval minus the exchange's phases (quorum, ring, exchange,
  fetch, vote, commit: where a fast replica waits for a slow one), i.e. data, forward, backward
  and optimizer (a `busy`/`compute` entry in the commit's `seconds` is used instead where the
  worker reports one).
- Achieved slowdown f': the victim's compute seconds per sample while throttled over the same in
  the run's unthrottled windows, both with the even assignment, so from the `off` run (each run
  reports its own too: with fewer micro-steps a replica spreads its per-step costs, optimizer
  and intra-replica sum, over fewer samples, so its own figure overstates f). f' is not f: with
  a CPU quota, a replica whose two ranks are throttled at different moments wait for each
  other; with SIGSTOP, a stopped replica leaves CPU to the others, and one running while its
  peers wait gets more of it (on a 2-core machine running 6 ranks that cancels most of f).
- Retained: throttled samples/s over the unthrottled samples/s of the same run, measured right
  before the throttle (the unthrottled windows, or the previous recovery's second half) and
  right after it (this recovery's second half), their mean: on a shared machine the load moves
  within a run, and a ratio against one early baseline drifts with it. `vs off` divides it by
  the `off` run's retained.
- Ideal, two ways. Perfect balancing on R replicas, one of them f' times slower, keeps
  (R - 1 + 1/f') / R of the even split's throughput (`ideal`, `vs ideal` = retained / it). That
  holds where every replica has its own hardware; here all share 2 cores, and the CPU a
  throttled replica cannot use goes to the others, so perfect balancing loses almost nothing
  and `vs ideal` exceeds 1. `ideal (direct)` measures it instead: the sum of every replica's
  own speed in the window over that sum in the references, so `vs direct` = the job's samples/s
  per unit of what its replicas could compute, against the same unthrottled: 1 is perfect
  balancing, whatever the hardware. It is the figure to read on this machine.
- Reaction: seconds from throttling to the first step that gives the victim less than the
  others' mean share or leaves it out.
- Flaps (under `--flap-policy`, default auto): the throttle at `--flap-factor` for `--flap-s`,
  off for `--flap-s`, twice, and a tail. Per segment: samples/s, assignment changes (a step's
  shares, as its `trained` ranges show them, differing from the previous step's, membership
  included), the planner's decisions where `fthsdp status` shows them (`planner_decisions`), and
  after each slowdown ends: seconds until the assignment is even again and changes after that
  (0: no thrashing; `flap_verdict`)."""

from __future__ import annotations

import contextlib
import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fthsdp.deploy.demo.events import CommitEvent, RunLog

PHASE_KEYS = ("quorum", "ring", "exchange", "fetch", "vote", "commit")
"""Commit-line phases that include waiting on other replicas: not a replica's own compute."""
COMPUTE_KEYS = ("busy", "compute")
"""A commit-line entry, if the worker reports one, that is the step's own compute time."""


# ---------------------------------------------------------------------------------------------
# The schedule as it ran


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """One stretch of the schedule at one throttle factor."""

    name: str
    kind: str
    """warmup, base, settle, slow, recover, flap-on, flap-off or tail."""
    factor: float
    seconds: float
    windows: int = 0
    """Measured windows it is cut into (0: not measured)."""
    skip_s: float = 0.0
    """Seconds at its start left out of its windows (a recovery's transition)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Span:
    """A segment as it ran: Unix seconds."""

    segment: Segment
    t0: float
    t1: float

    def windows(self) -> list[tuple[float, float]]:
        n = self.segment.windows
        start = min(self.t0 + self.segment.skip_s, self.t1)
        width = (self.t1 - start) / max(1, n)
        return [(start + i * width, start + (i + 1) * width) for i in range(n) if width > 0]


# ---------------------------------------------------------------------------------------------
# Reading a run's logs


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A committed step, as first logged by any replica."""

    step: int
    t: float
    trained: Mapping[str, tuple[int, int]]

    @property
    def samples(self) -> int:
        return sum(end - start for start, end in self.trained.values())

    @property
    def shares(self) -> tuple[tuple[str, int], ...]:
        """Samples per contributor: the assignment this step ran with."""
        return tuple(sorted((r, end - start) for r, (start, end) in self.trained.items()))


def first_commits(log: RunLog) -> list[StepRecord]:
    """Each committed step once, at its earliest commit line, by step."""
    first: dict[int, CommitEvent] = {}
    for c in log.commits():
        if c.step not in first or c.t < first[c.step].t:
            first[c.step] = c
    return [StepRecord(c.step, c.t, dict(c.trained)) for _, c in sorted(first.items())]


def job_rate(steps: Sequence[StepRecord], t0: float, t1: float) -> float | None:
    """Samples/s committed in [t0, t1)."""
    if t1 <= t0:
        return None
    return sum(s.samples for s in steps if t0 <= s.t < t1) / (t1 - t0)


@dataclass(frozen=True, slots=True)
class Work:
    """One step of one replica's own compute."""

    t: float
    compute_s: float
    samples: int


def own_work(log: RunLog, replica: str) -> list[Work]:
    """A replica's compute per committed step (consecutive commits of its leader, its own
    contribution only; a step it caught up in, or a restart in between, is left out)."""
    out = []
    commits = log.commits(replica)
    for a, b in itertools.pairwise(commits):
        if b.step != a.step + 1 or b.recovered or replica not in b.trained or b.t <= a.t:
            continue
        compute = next((b.seconds[k] for k in COMPUTE_KEYS if k in b.seconds), None)
        if compute is None:
            compute = (b.t - a.t) - sum(b.seconds.get(k, 0.0) for k in PHASE_KEYS)
        start, end = b.trained[replica]
        if compute > 0 and end > start:
            out.append(Work(b.t, compute, end - start))
    return out


def speed(work: Sequence[Work], t0: float, t1: float) -> float | None:
    """Samples per second of own compute in [t0, t1); None when it trained nothing there."""
    inside = [w for w in work if t0 <= w.t < t1]
    seconds = sum(w.compute_s for w in inside)
    return sum(w.samples for w in inside) / seconds if inside and seconds > 0 else None


def is_even(shares: tuple[tuple[str, int], ...], replicas: int) -> bool:
    return len(shares) == replicas and len({n for _, n in shares}) == 1


def changes(steps: Sequence[StepRecord], t0: float, t1: float) -> list[dict[str, Any]]:
    """Each step in [t0, t1) whose assignment differs from the previous step's."""
    out = []
    prev: StepRecord | None = None
    for s in steps:
        if prev is not None and t0 <= s.t < t1 and s.shares != prev.shares:
            out.append({"t": s.t, "step": s.step, "shares": dict(s.shares)})
        prev = s
    return out


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def measure(
    log: RunLog, spans: Sequence[Span], victim: str, replicas: Sequence[str]
) -> dict[str, Any]:
    """Every figure of one run (see the module doc)."""
    steps = first_commits(log)
    work = {r: own_work(log, r) for r in replicas}

    def windows(span: Span) -> list[dict[str, Any]]:
        out = []
        for a, b in span.windows():
            speeds = {r: speed(work[r], a, b) for r in replicas}
            victim_work = [w for w in work[victim] if a <= w.t < b]
            known = [v for v in speeds.values() if v is not None]
            out.append(
                {
                    "t0": a,
                    "t1": b,
                    "samples_per_s": job_rate(steps, a, b),
                    "speeds": speeds,
                    "capacity": sum(known) if len(known) == len(speeds) else None,
                    "victim_s_per_sample": sum(w.compute_s for w in victim_work)
                    / sum(w.samples for w in victim_work)
                    if victim_work
                    else None,
                }
            )
        return out

    base = [w for s in spans if s.segment.kind == "base" for w in windows(s)]
    out: dict[str, Any] = {"base": {"windows": base, **_summary(base)}, "slow": {}, "flaps": []}
    before = base
    for i, span in enumerate(spans):
        kind = span.segment.kind
        if kind == "slow":
            after = next((windows(s) for s in spans[i + 1 :] if s.segment.kind == "recover"), [])
            out["slow"][f"{span.segment.factor:g}"] = _slow(
                windows(span), [before, after], steps, spans, span, victim
            )
            before = after or before
        elif kind.startswith("flap") or kind == "tail":
            out["flaps"].append(_flap_segment(span, steps, len(replicas)))
    out["changes_total"] = len(changes(steps, 0.0, float("inf")))
    return out


def _summary(ws: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Medians over windows of the job's samples/s, the victim's compute per sample and the
    sum of the replicas' own speeds."""
    return {
        key: _median([w[key] for w in ws])
        for key in ("samples_per_s", "victim_s_per_sample", "capacity")
    }


def _slow(
    ws: list[dict[str, Any]],
    refs: Sequence[Sequence[Mapping[str, Any]]],
    steps: Sequence[StepRecord],
    spans: Sequence[Span],
    span: Span,
    victim: str,
) -> dict[str, Any]:
    """A throttled segment against the unthrottled references right before and right after it
    (their mean, so load drift during the run cancels to first order)."""
    summaries = [_summary(r) for r in refs if r]
    ref: dict[str, float | None] = {}
    for key in ("samples_per_s", "victim_s_per_sample", "capacity"):
        known = [v for s in summaries if (v := s[key])]
        ref[key] = statistics.mean(known) if known else None
    rate = _median([w["samples_per_s"] for w in ws])
    settle = next(
        (s for s in spans if s.segment.kind == "settle" and s.t1 <= span.t0 + 1e-6
         and s.segment.factor == span.segment.factor),
        None,
    )  # fmt: skip
    start = settle.t0 if settle is not None else span.t0
    return {
        "windows": ws,
        "reference": ref,
        "samples_per_s": rate,
        "retained": _ratio(rate, ref["samples_per_s"]),
        "achieved_slowdown": _median(
            [_ratio(w["victim_s_per_sample"], ref["victim_s_per_sample"]) for w in ws]
        ),
        "ideal_direct": _median([_ratio(w["capacity"], ref["capacity"]) for w in ws]),
        "reaction_s": _reaction(steps, start, span.t1, victim),
        "changes": len(changes(steps, start, span.t1)),
    }


def victim_held_back(shares: tuple[tuple[str, int], ...], victim: str) -> bool:
    """Whether an assignment gives the victim less than the others' mean share, or leaves it
    out: the planner acting on its slowness, not on noise among the others."""
    mine = dict(shares)
    others = [n for r, n in shares if r != victim]
    return victim not in mine or (bool(others) and mine[victim] < sum(others) / len(others))


def _reaction(steps: Sequence[StepRecord], t0: float, t1: float, victim: str) -> float | None:
    first = next((s for s in steps if t0 <= s.t < t1 and victim_held_back(s.shares, victim)), None)
    return None if first is None else first.t - t0


def _flap_segment(span: Span, steps: Sequence[StepRecord], replicas: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": span.segment.name,
        "kind": span.segment.kind,
        "factor": span.segment.factor,
        "t0": span.t0,
        "t1": span.t1,
        "samples_per_s": job_rate(steps, span.t0, span.t1),
        "changes": changes(steps, span.t0, span.t1),
    }
    if span.segment.kind in ("flap-off", "tail"):
        even = next(
            (s for s in steps if span.t0 <= s.t < span.t1 and is_even(s.shares, replicas)), None
        )
        row["even_after_s"] = None if even is None else even.t - span.t0
        # By step, not time: a wall-clock time plus a nanosecond is the same float.
        row["changes_once_even"] = (
            None
            if even is None
            else sum(1 for c in changes(steps, even.t, span.t1) if c["step"] > even.step)
        )
    return row


# ---------------------------------------------------------------------------------------------
# Comparing the policies


def compare(runs: Mapping[str, dict[str, Any]], replicas: int) -> dict[str, dict[str, Any]]:
    """Per slowdown and policy: retained, vs off, the achieved slowdown and vs ideal."""
    out: dict[str, dict[str, Any]] = {}
    factors = sorted({f for run in runs.values() for f in run.get("slow", {})}, key=float)
    for f in factors:
        rows = {p: run["slow"][f] for p, run in runs.items() if f in run.get("slow", {})}
        off = rows.get("off", {})
        others = _median([r["achieved_slowdown"] for r in rows.values()])
        out[f] = {}
        for policy, row in rows.items():
            own = row["achieved_slowdown"]
            achieved, source = off.get("achieved_slowdown"), "off"
            if achieved is None:
                achieved, source = (own, "own") if own is not None else (others, "other runs")
            ideal = None if not achieved else (replicas - 1 + 1 / achieved) / replicas
            out[f][policy] = {
                "samples_per_s": row["samples_per_s"],
                "retained": row["retained"],
                "achieved_slowdown": achieved,
                "achieved_from": source,
                "own_victim_slowdown": own,
                "ideal": ideal,
                "vs_off": _ratio(row["retained"], off.get("retained")),
                "vs_ideal": _ratio(row["retained"], ideal),
                "vs_ideal_direct": _ratio(row["retained"], row["ideal_direct"]),
                "reaction_s": row["reaction_s"],
            }
    return out


# ---------------------------------------------------------------------------------------------
# The planner's decisions, as `fthsdp status` shows them


def planner_decisions(status: Any) -> list[dict[str, Any]]:
    """The fail-slow planner's decisions in a `fthsdp status --json` document: every object
    with an `action` (keep, rebalance, evict) wherever it sits, e.g. a `decisions` list."""
    found: list[dict[str, Any]] = []
    if isinstance(status, Mapping):
        if isinstance(status.get("action"), str):
            found.append(dict(status))
        else:
            for value in status.values():
                found += planner_decisions(value)
    elif isinstance(status, list):
        for value in status:
            found += planner_decisions(value)
    return found


def decisions_in(decisions: Sequence[Mapping[str, Any]], t0: float, t1: float) -> int:
    """How many of `decisions` were taken in [t0, t1) by their `decided_at` (Unix seconds or
    ISO 8601); one without a readable time counts nowhere."""
    return sum(1 for d in decisions if _decided_in(d, t0, t1))


def _decided_in(decision: Mapping[str, Any], t0: float, t1: float) -> bool:
    at = decision.get("decided_at")
    if isinstance(at, str):
        with contextlib.suppress(ValueError):
            at = datetime.fromisoformat(at).timestamp()
    return isinstance(at, int | float) and t0 <= at < t1


def flap_verdict(flaps: Sequence[Mapping[str, Any]]) -> tuple[bool, bool]:
    """(thrashing, unsettled) of a run's come-and-go segments: thrashing when the assignment
    changed again after it was back to even in a segment with the throttle off; unsettled when
    the tail never got back to even."""
    offs = [seg for seg in flaps if seg["kind"] in ("flap-off", "tail")]
    thrash = any(seg.get("changes_once_even") for seg in offs)
    unsettled = any(seg.get("even_after_s") is None for seg in offs if seg["kind"] == "tail")
    return thrash, unsettled
