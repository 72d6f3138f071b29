"""Judge a demo run directory: the final JSON report with invariants I1, I2 and I6, the cost of
every injected failure, and the effective training time, from the run's events (`events.py`)."""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fthsdp.deploy.demo.events import (
    CommitEvent,
    EndEvent,
    ExitEvent,
    FinalEvent,
    InjectEvent,
    QuorumEvent,
    RollbackEvent,
    RunEvent,
    RunLog,
    StartEvent,
)


@dataclass(kw_only=True, slots=True)
class _Ledger:
    """What was trained, reconciled over the commit lines of every logger."""

    spans: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    """(step, contributing replica) → [start, end) shard positions."""
    inconsistencies: list[dict[str, Any]] = field(default_factory=list)
    """Loggers disagreeing about a step's contributors or a contributor's range."""
    rolled_back: int = 0
    """Replica-steps committed, then thrown away by a rollback to a durable checkpoint."""


def _unannounced_rollbacks(log: RunLog, commits: list[CommitEvent]) -> list[float]:
    """Rollbacks no launcher announced: every replica was lost at once and the job went on from
    its last durable checkpoint (restart policy `replica`). One shows as a commit, by a replica
    that started again (at or below that step) since, of a step it had committed already itself,
    or two or more steps behind one any replica made: replicas of one quorum commit within a step
    of each other, and a replica that restarts catches up past its last commit, so nothing else
    goes back. Its time starts the new generation (it is the first commit of it). `commits` are
    the log's commits in time order."""
    starts = [e for events in log.replicas.values() for e in events if isinstance(e, StartEvent)]
    times: list[float] = []
    frontier, frontier_t = -1, float("-inf")
    last: dict[str, tuple[int, float]] = {}
    """Per replica, its newest commit (step, time) in the current generation."""
    for c in commits:
        own_step, own_t = last.get(c.replica, (-1, float("-inf")))
        behind = c.step <= frontier - 2 or c.step <= own_step
        since = frontier_t if c.step <= frontier - 2 else own_t
        if behind and any(
            s.replica == c.replica and since < s.t < c.t and s.step <= c.step for s in starts
        ):
            times.append(c.t)
            frontier = c.step
            last = {}
        if c.step >= frontier:
            frontier, frontier_t = c.step, c.t
        last[c.replica] = (c.step, c.t)
    return times


def _ledger(log: RunLog) -> _Ledger:
    ledger = _Ledger()
    # Every replica that commits a step logs the same `trained` map, so any logger is a witness
    # for every contributor; keeping the first witness and comparing the rest finds disagreement.
    # After a rollback only the latest generation of a step is history.
    commits = log.commits()
    announced = [e.t for e in log.of_type(RollbackEvent)]
    rollbacks = sorted(announced + _unannounced_rollbacks(log, commits))
    generation = {id(c): bisect.bisect_right(rollbacks, c.t) for c in commits}
    lowest: dict[int, int] = {}
    """Per generation, the lowest step committed in it: where the job went back to."""
    for c in commits:
        g = generation[id(c)]
        lowest[g] = min(lowest.get(g, c.step), c.step)

    def thrown_away(c: CommitEvent) -> bool:
        # A later generation went back to this step or before it: this commit is history no
        # more, even at steps the later generation has not reached again (yet).
        g = generation[id(c)]
        return any(step <= c.step for k, step in lowest.items() if k > g)

    stale = [c for c in commits if thrown_away(c)]
    ledger.rolled_back = len({(c.step, r) for c in stale for r in c.trained})
    witness: dict[tuple[int, str], str] = {}
    contributors: dict[int, tuple[str, frozenset[str]]] = {}
    for c in commits:
        if thrown_away(c):
            continue
        seen = contributors.setdefault(c.step, (c.replica, frozenset(c.trained)))
        if seen[1] != frozenset(c.trained):
            ledger.inconsistencies.append(
                {
                    "kind": "contributors",
                    "step": c.step,
                    "loggers": {seen[0]: sorted(seen[1]), c.replica: sorted(c.trained)},
                }
            )
        for replica, span in c.trained.items():
            key = (c.step, replica)
            if key not in ledger.spans:
                ledger.spans[key], witness[key] = span, c.replica
            elif ledger.spans[key] != span:
                ledger.inconsistencies.append(
                    {
                        "kind": "range",
                        "step": c.step,
                        "replica": replica,
                        "loggers": {witness[key]: list(ledger.spans[key]), c.replica: list(span)},
                    }
                )
    return ledger


def _samples(ledger: _Ledger, replica: str) -> list[dict[str, int]]:
    rows = [
        {"step": step, "start": span[0], "end": span[1]}
        for (step, r), span in ledger.spans.items()
        if r == replica
    ]
    return sorted(rows, key=lambda row: (row["start"], row["step"]))


def _merge(rows: list[dict[str, int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for row in rows:
        if merged and row["start"] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], row["end"])
        else:
            merged.append([row["start"], row["end"]])
    return merged


def _exactly_once_violation(
    rows: list[dict[str, int]], samples_per_step: int, origin: int = 0
) -> str | None:
    """The first way `rows` (sorted by start) fails to tile [origin, end) once, in step order."""
    expected, last_step = origin, -1
    for row in rows:
        where = f"step {row['step']} [{row['start']}, {row['end']})"
        if row["start"] > expected:
            return f"gap: positions [{expected}, {row['start']}) never trained before {where}"
        if row["start"] < expected:
            return f"overlap: {where} retrains positions before {expected}"
        if samples_per_step and (row["end"] - row["start"]) % samples_per_step:
            return f"size: {where} is not a whole number of {samples_per_step}-position micro-steps"
        if row["step"] <= last_step:
            return f"order: {where} comes after step {last_step} in the data stream"
        expected, last_step = row["end"], row["step"]
    return None


def _invariant_i1(log: RunLog) -> dict[str, Any]:
    finals: dict[str, FinalEvent] = {}
    for replica, events in log.replicas.items():
        for e in events:
            if isinstance(e, FinalEvent):
                finals[replica] = e
    if not finals:
        return {"ok": False, "detail": "no replica reported a final state"}
    top = max(f.step for f in finals.values())
    at_top = {r: f.fingerprint for r, f in sorted(finals.items()) if f.step == top}
    ok = len(set(at_top.values())) == 1
    detail = f"{len(at_top)} replica(s) at step {top} " + (
        "share one fingerprint" if ok else f"differ: {at_top}"
    )
    return {"ok": ok, "detail": detail}


def _invariant_i2(
    log: RunLog, ledger: _Ledger, samples: Mapping[str, list[dict[str, int]]]
) -> dict[str, Any]:
    if ledger.inconsistencies:
        first = ledger.inconsistencies[0]
        return {"ok": False, "detail": f"loggers disagree: {json.dumps(first, sort_keys=True)}"}
    sps = log.run.samples_per_step if log.run is not None else 0
    # A job resumed from a durable checkpoint starts at the positions committed with it; the
    # continuity with the earlier run is checked against that run's report.
    starts = [
        e.step for events in log.replicas.values() for e in events if isinstance(e, StartEvent)
    ]
    resumed = bool(starts) and min(starts) > 0
    for replica, rows in samples.items():
        origin = rows[0]["start"] if resumed and rows else 0
        violation = _exactly_once_violation(rows, sps, origin)
        if violation is not None:
            return {"ok": False, "detail": f"{replica}: {violation}"}
    trained = sum(r["end"] - r["start"] for rows in samples.values() for r in rows)
    return {"ok": True, "detail": f"{trained} samples trained exactly once"}


def _invariant_i6(log: RunLog) -> dict[str, Any]:
    """No quorum smaller than min_replicas: a minority of the job never trained alone. (The
    other half of I6, a majority of the live replicas in every round, is the quorum service's
    own rule; its unit tests check it.)"""
    floor = log.run.min_replicas if log.run is not None else 1
    quorums = log.of_type(QuorumEvent)
    small = next((q for q in quorums if len(q.members) < floor), None)
    if small is not None:
        return {
            "ok": False,
            "detail": f"quorum {small.quorum_id} had {len(small.members)} of min {floor} replicas",
        }
    return {"ok": True, "detail": f"{len(quorums)} quorums, each of at least {floor} replicas"}


def _median_commit_interval(log: RunLog) -> float:
    gaps: list[float] = []
    for replica in log.replicas:
        times = [c.t for c in log.commits(replica)]
        gaps.extend(b - a for a, b in itertools.pairwise(times))
    return statistics.median(gaps) if gaps else 0.0


def _survivor_stall(log: RunLog, inject: InjectEvent, until: float, median: float) -> float | None:
    """Largest commit gap of any other replica that overlaps [inject, until] (the failure until
    its victim commits again), beyond the usual interval. A replica that failed itself within
    a gap is no survivor there: that gap is its own outage."""
    failures = [e for e in log.supervisor if isinstance(e, InjectEvent | ExitEvent)]
    worst: float | None = None
    for replica in log.replicas:
        if replica == inject.replica:
            continue
        times = [c.t for c in log.commits(replica)]
        for a, b in itertools.pairwise(times):
            if a > until or b < inject.t:
                continue
            if any(f.replica == replica and a <= f.t <= b for f in failures):
                continue
            worst = max(worst or 0.0, b - a)
    return None if worst is None else max(0.0, worst - median)


_CONTROL_PLANE_WINDOW_S = 10.0


def _control_plane_failure(
    log: RunLog, inject: InjectEvent, median: float, t0: float
) -> dict[str, Any]:
    """A restart of the quorum service (or its leader's death, with a standby): no replica is
    evicted; what matters is how long the replicas stalled and when training went on. A standby
    that takes over with the same membership forms no new quorum id, so the window is bounded by
    the next injection (at most `_CONTROL_PLANE_WINDOW_S`) rather than by a quorum event."""
    later = [e.t for e in log.of_type(InjectEvent) if e.t > inject.t]
    until = min([inject.t + _CONTROL_PLANE_WINDOW_S, *later])
    stall = _survivor_stall(log, inject, until, median)
    back = next((c for c in log.commits() if c.t > inject.t + (stall or 0.0)), None)
    return {
        "t": round(inject.t - t0, 3),
        "replica": None,
        "mode": inject.mode,
        "rank": None,
        "step": _step_at(log, inject.t),
        "detection_s": None,
        "survivor_stall_s": None if stall is None else round(stall, 3),
        "time_to_healthy_s": None if back is None else round(back.t - inject.t, 3),
        "healthy_step": None if back is None else back.step,
    }


def _failure(log: RunLog, inject: InjectEvent, median: float, t0: float) -> dict[str, Any]:
    if inject.replica is None:
        return _control_plane_failure(log, inject, median, t0)
    quorums = [q for q in log.of_type(QuorumEvent) if q.t > inject.t]
    evicted = next((q for q in quorums if inject.replica not in q.members), None)
    detection = None if evicted is None else evicted.t - inject.t
    # A commit logged right after the inject may have raced the kill; only a commit after the
    # victim restarted (or, without a restart, after it was evicted) shows it healthy again.
    restarts = [
        e.t
        for e in log.replicas.get(inject.replica, [])
        if isinstance(e, StartEvent) and e.t > inject.t
    ]
    back_from = restarts[0] if restarts else (evicted.t if evicted else inject.t)
    rejoin = next((c for c in log.commits(inject.replica) if c.t > back_from), None)
    # Until the victim is healthy again, not just evicted: a stall while it rejoins and catches
    # up counts too.
    until = rejoin.t if rejoin else evicted.t if evicted else inject.t
    stall = _survivor_stall(log, inject, until, median)
    return {
        "t": round(inject.t - t0, 3),
        "replica": inject.replica,
        "mode": inject.mode,
        "rank": inject.rank,
        "step": _step_at(log, inject.t),
        "detection_s": None if detection is None else round(detection, 3),
        "survivor_stall_s": None if stall is None else round(stall, 3),
        "time_to_healthy_s": None if rejoin is None else round(rejoin.t - inject.t, 3),
        "healthy_step": None if rejoin is None else rejoin.step,
    }


def _end_phase(
    log: RunLog, failures: list[dict[str, Any]], t0: float, t1: float
) -> dict[str, Any] | None:
    """When the end phase began (seconds since the start, and the step then worked on): the
    launcher injects nothing in the run's last stretch, then stops every replica at one agreed
    step. The log has no line for it, so this is the moment it had certainly begun: the last
    failure healed and, with a failure period, the slot `kill_every_s` after the last injection
    passed within the run without a failure (a due one is put off only while a replica is
    down). None without injected failures, or when one never healed."""
    if not failures or any(f["time_to_healthy_s"] is None for f in failures):
        return None
    start = max(f["t"] + f["time_to_healthy_s"] for f in failures)
    period = log.run.kill_every_s if log.run is not None else None
    if period:
        slot = max(f["t"] for f in failures) + period
        if slot < t1 - t0:
            start = max(start, slot)
    if start >= t1 - t0:
        return None
    return {"t": round(start, 3), "step": _step_at(log, t0 + start)}


def _step_at(log: RunLog, t: float) -> int:
    """The step the healthy replicas stood at (were working on) at time t."""
    done = [c.step for c in log.commits() if c.t <= t]
    return max(done) + 1 if done else 0


def _start_time(log: RunLog) -> float:
    if log.run is not None:
        return log.run.t
    times = [e.t for e in log.supervisor] + [e.t for es in log.replicas.values() for e in es]
    return min(times, default=0.0)


def _end_time(log: RunLog) -> float:
    ends = log.of_type(EndEvent)
    if ends:
        return float(ends[-1].t)
    times = [e.t for e in log.supervisor] + [e.t for es in log.replicas.values() for e in es]
    return max(times, default=0.0)


def _tokens(log: RunLog, ledger: _Ledger) -> int:
    """Tokens of every useful (step, replica) pair, from the contributor's own commit line; a
    contributor killed before it logged is counted at the median of logged contributions."""
    logged = {(c.step, c.replica): c.tokens for c in log.commits() if c.replica in c.trained}
    fill = int(statistics.median(logged.values())) if logged else 0
    return sum(logged.get(key, fill) for key in ledger.spans)


def _series(log: RunLog, t0: float) -> dict[str, Any]:
    losses = {
        r: [[c.step, c.loss] for c in log.commits(r) if c.loss is not None] for r in log.replicas
    }
    healthy = [[round(q.t - t0, 3), len(q.healthy), q.quorum_id] for q in log.of_type(QuorumEvent)]
    return {"loss": losses, "healthy": healthy}


def analyse(log: RunLog) -> dict[str, Any]:
    """The report of a loaded run (see `build_report`)."""
    ledger = _ledger(log)
    ids = log.replica_ids()
    samples = {r: _samples(ledger, r) for r in ids}
    t0, t1 = _start_time(log), _end_time(log)
    median = _median_commit_interval(log)
    finals = {
        r: next((e for e in reversed(log.replicas.get(r, [])) if isinstance(e, FinalEvent)), None)
        for r in ids
    }
    steps = {step for step, _ in ledger.spans} | {c.step for c in log.commits()}
    total = log.run.total_replicas if log.run is not None else len(ids)
    possible = total * len(steps)
    wall = max(0.0, t1 - t0)
    tokens = _tokens(log, ledger)
    failures = [_failure(log, i, median, t0) for i in log.of_type(InjectEvent)]
    return {
        "run": None if log.run is None else _run_dict(log.run),
        "replicas": {r: _replica_entry(log, r, finals[r], samples[r]) for r in ids},
        "invariants": {
            "I1": _invariant_i1(log),
            "I2": _invariant_i2(log, ledger, samples),
            "I6": _invariant_i6(log),
        },
        "inconsistencies": ledger.inconsistencies,
        "failures": failures,
        "end_phase": _end_phase(log, failures, t0, t1),
        "effective_training_time": None
        if possible == 0
        else round(len(ledger.spans) / possible, 4),
        "summary": {
            "steps_committed": len(steps),
            "useful_replica_steps": len(ledger.spans),
            "rolled_back_replica_steps": ledger.rolled_back,
            "possible_replica_steps": possible,
            "wall_time_s": round(wall, 3),
            "median_step_s": round(median, 4),
            "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
            "failures_injected": len(log.of_type(InjectEvent)),
            "quorums": len(log.of_type(QuorumEvent)),
        },
        "series": _series(log, t0),
        "skipped_lines": log.skipped,
    }


def _replica_entry(
    log: RunLog, replica: str, final: FinalEvent | None, samples: list[dict[str, int]]
) -> dict[str, Any]:
    return {
        "final_step": None if final is None else final.step,
        "fingerprint": None if final is None else final.fingerprint,
        "commits": len(log.commits(replica)),
        "samples": samples,
        "coverage": _merge(samples),
    }


def _run_dict(run: RunEvent) -> dict[str, Any]:
    return {
        "replicas": list(run.replicas),
        "world_size": run.world_size,
        "kill_every_s": run.kill_every_s,
        "kill_mode": run.kill_mode,
        "seed": run.seed,
        "samples_per_step": run.samples_per_step,
        "total_replicas": run.total_replicas,
        "min_replicas": run.min_replicas,
    }


def build_report(run_dir: str | Path) -> dict[str, Any]:
    """The JSON-ready report of a run directory: per replica its final step, fingerprint and the
    exact shard positions it trained; invariants I1 and I2; per injected failure its detection
    time, the survivors' stall and the time (and step) at which the victim was healthy again;
    when the end phase began; the effective training time; summary numbers; and the series the
    plots draw."""
    return analyse(RunLog.load(run_dir))


def write_report(run_dir: str | Path, path: str | Path) -> dict[str, Any]:
    """Build the report and write it as indented JSON (atomically: a reader never sees half)."""
    report = build_report(run_dir)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return report
