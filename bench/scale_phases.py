"""The figures of each `bench.scale` phase, from what the client processes and the services
answered: pure functions of those answers (times are monotonic timestamps)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from fthsdp.bench.scale_model import Shape, Victim, percentile, rounds_of, stage
from fthsdp.services.health.config import HealthConfig

RANK_BEAT_S = 0.2
"""How often a rank beats to its node agent (`TelemetryClient`'s heartbeat_interval)."""


def _errors(answers: Sequence[Any]) -> list[str]:
    return [a["error"] for a in answers if isinstance(a, dict) and "error" in a]


def _ok(answers: Sequence[Any]) -> list[dict[str, Any]]:
    return [a for a in answers if isinstance(a, dict) and "error" not in a]


def setup_result(answers: Sequence[Any], shape: Shape, deadline_s: float) -> dict[str, Any]:
    """Joins and the leaders' Watch streams over every client."""
    ok = _ok(answers)
    live = sum(a["streams_live"] for a in ok)
    total = sum(a["streams_total"] for a in ok)
    agents_live = sum(a.get("agent_streams_live", 0) for a in ok)
    agents_total = sum(a.get("agent_streams_total", 0) for a in ok)
    agent_failures = sum(a.get("agent_stream_failures", 0) for a in ok)
    agent_reasons: Counter[str] = Counter()
    for a in ok:
        agent_reasons.update(a.get("agent_stream_failure_reasons", {}))
    joined = sum(a["joined"] for a in ok)
    join_errors = [e for a in ok for e in a["join_errors"]]
    incomplete = [f"setup: {e}" for e in _errors(answers)]
    if joined < shape.replicas:
        first = f": {join_errors[0]}" if join_errors else ""
        incomplete.append(f"leaders joined: {joined} / {shape.replicas}{first}")
    if live < joined:
        incomplete.append(
            f"leader Watch streams live: {live:,} / {joined:,} after {deadline_s:g} s"
        )
    if agents_live < agents_total:
        incomplete.append(
            f"agent Watch streams live: {agents_live:,} / {agents_total:,} after {deadline_s:g} s"
        )
    return {
        "joined": joined,
        "join_errors": join_errors,
        "join_s": max((a["join_s"] for a in ok), default=None),
        "streams_live": live,
        "streams_total": total,
        "agent_streams_live": agents_live,
        "agent_streams_total": agents_total,
        "agent_stream_failures": agent_failures,
        "agent_stream_failure_reasons": dict(agent_reasons.most_common()),
        "setup_s": max((a["setup_s"] for a in ok), default=None),
        "incomplete": incomplete,
    }


def rounds_result(
    first: Sequence[Any],
    steady: Sequence[Any],
    timings: Sequence[tuple[int, int, float]],
    service_cpu_s: float | None,
    rounds: int,
) -> dict[str, Any]:
    """The first round (every member, the endpoints each leader needs), then steady rounds."""
    first_ok, steady_ok = _ok(first), _ok(steady)
    leaders = sum(a["leaders"] for a in steady_ok)
    client = rounds_of([a["steps"] for a in steady_ok]) if steady_ok else []
    server = [seconds for _, participants, seconds in timings if participants == leaders]
    responses = sum(a["responses"] for a in steady_ok)
    data = sum(a["bytes"] for a in steady_ok)
    incomplete = [f"rounds: {e}" for e in _errors([*first, *steady])]
    errors = [e for a in [*first_ok, *steady_ok] for e in a["errors"]]
    if len(client) < rounds:
        incomplete.append(f"steady rounds: {len(client)} / {rounds} completed")
    evicted = sorted({e for a in [*first_ok, *steady_ok] for e in a["foreign_evictions"]})
    if evicted:
        incomplete.append(f"rounds: {len(evicted)} healthy replicas evicted, e.g. {evicted[0]}")
    return {
        "leaders": leaders,
        "first": {
            "client_s": next(iter(rounds_of([a["steps"] for a in first_ok])), None),
            "bytes": sum(a["bytes"] for a in first_ok),
            "responses": sum(a["responses"] for a in first_ok),
        },
        "rounds": len(client),
        "server_ms": [1000 * s for s in server],
        "client_ms": [1000 * s for s in client],
        "server_p50_ms": _ms(percentile(server, 0.5)),
        "server_p99_ms": _ms(percentile(server, 0.99)),
        "client_p50_ms": _ms(percentile(client, 0.5)),
        "client_p99_ms": _ms(percentile(client, 0.99)),
        "service_cpu_s": service_cpu_s,
        "service_cpu_ms_per_round": None
        if service_cpu_s is None or not client
        else 1000 * service_cpu_s / len(client),
        "bytes_per_round": data / len(client) if client else None,
        "bytes_per_response": data / responses if responses else None,
        "errors": errors,
        "foreign_evictions": evicted,
        "incomplete": incomplete,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def failure_result(
    answers: Sequence[Any],
    victim: Victim,
    death: float,
    reports: Sequence[tuple[float, float, str, str]],
    survivors: Sequence[int],
    shape: Shape,
    deadline_s: float,
    agent_streams: str = "filtered",
) -> dict[str, Any]:
    """The stages of one failure, from the victim's death (monotonic), with the victim's agent's
    reports (started, answered, replica id, outcome); the last stage is the victim's node agents
    hearing its eviction on their streams (`agent_streams`: their mode; none with "off")."""
    ok = _ok(answers)
    early = [r for r in reports if r[0] < death]
    reports = [r for r in reports if r[0] >= death]
    outcomes: dict[int, dict[str, Any]] = {}
    for a in ok:
        outcomes.update({int(k): v for k, v in a["replicas"].items()})
    mine = [outcomes[r] for r in survivors if r in outcomes]
    ranks = len(survivors) * shape.ranks
    answered = next((end for _, end, _, outcome in reports if outcome == "evicted"), None)
    seen = [a["first_seen"] for a in ok if a.get("first_seen") is not None]
    # Each is a moment by which the service had evicted it: the report's answer, or the first
    # Watch event of it at any rank (the events go out before the answer).
    bounds = [t for t in (answered, min(seen, default=None)) if t is not None]
    evicted = min(bounds, default=None)
    reported = reports[0][0] if reports else None
    origin = death
    stages = [
        stage("evicted", origin, [evicted], 1, deadline_s),
        stage("ranks notified", origin, [t for o in mine for t in o["aborted"]], ranks, deadline_s),
        stage("replicas voted", origin, [o["voted_at"] for o in mine], len(survivors), deadline_s),
        stage(
            "leaders left it out", origin, [o["first_at"] for o in mine], len(survivors), deadline_s
        ),
        stage(
            "leaders hold quorum",
            origin,
            [o["leader_at"] for o in mine],
            len(survivors),
            deadline_s,
        ),
        stage(
            "ranks hold ring", origin, [t for o in mine for t in o["ring_at"]], ranks, deadline_s
        ),
        stage(
            "its agents heard it",
            origin,
            [t for a in ok for t in a.get("agents_heard", ())],
            shape.hosts_per_replica if agent_streams != "off" else 0,
            deadline_s,
        ),
    ]
    incomplete = [f"failure {victim.replica_id}:{victim.rank}: {e}" for e in _errors(answers)]
    if early:
        incomplete.append(
            f"failure {victim.replica_id}:{victim.rank}: its agent reported it {len(early)} times "
            "before the rank died (its beats were late: a loaded machine)"
        )
    incomplete += [
        f"failure {victim.replica_id}:{victim.rank}: {s.name}: {s.describe()}"
        for s in stages
        if not s.complete and s.total > 0
    ]
    foreign = sorted({e for a in ok for e in a["foreign_evictions"]})
    if foreign:
        incomplete.append(
            f"failure {victim.replica_id}:{victim.rank}: {len(foreign)} healthy replicas "
            f"evicted meanwhile, e.g. {foreign[0]}"
        )
    wrong = sum(o["wrong_neighbours"] for o in mine)
    if wrong:
        incomplete.append(
            f"failure {victim.replica_id}:{victim.rank}: {wrong:,} ranks hold a wrong ring"
        )
    return {
        "victim": {"replica_id": victim.replica_id, "rank": victim.rank},
        "survivors": len(survivors),
        "death": death,
        "detected_s": None if reported is None else reported - death,
        "report_answered_s": None if answered is None else answered - death,
        "reports_before_death": len(early),
        "stages": [s.to_dict() for s in stages],
        "agent_messages": sum(a.get("agent_messages", 0) for a in ok),
        "via_exchange_timeout": sum(o["via_timeout"] for o in mine),
        "epochs": max((o["epochs"] for o in mine), default=0),
        "wrong_neighbours": wrong,
        "quorum_ids": sorted({o["quorum_id"] for o in mine}),
        "ring_sizes": sorted({len(o["ring"]) for o in mine}),
        "reports": reports,
        "errors": sorted({e for o in mine for e in o["errors"]}),
        "foreign_evictions": foreign,
        "replicas": outcomes,
        "incomplete": incomplete,
    }


def ingest_result(
    answers: Sequence[Any],
    config: HealthConfig,
    central_cpu_s: float | None,
    served: int,
    idle_share: float | None = None,
) -> dict[str, Any]:
    """Needed vs acknowledged health ingest of the agents that forward (the hosts of the live
    replicas), at the interval central asked them for (their own when it asked for none), and
    the central service's CPU per forward it completed (`served`, its own count:
    also those whose sender had given up on them), less what it spends idle (`idle_share` of a
    core: its evaluation timer)."""
    ok = _ok(answers)
    asked = max((a["asked_interval_s"] for a in ok), default=0.0)
    interval = max(config.forward_interval.total_seconds(), asked)
    window = max((a["window_s"] for a in ok), default=0.0)
    phase = max((a["phase_s"] for a in ok), default=0.0)
    acked = sum(a["acked"] for a in ok)
    entries = sum(a["rank_entries"] for a in ok)
    agents, ranks = sum(a["agents"] for a in ok), sum(a["ranks"] for a in ok)
    busy = None
    if central_cpu_s is not None:
        busy = max(0.0, central_cpu_s - (idle_share or 0.0) * phase)
    result: dict[str, Any] = {
        "needed_beats_per_s": ranks / RANK_BEAT_S,
        "needed_forwards_per_s": agents / interval,
        "needed_rank_entries_per_s": ranks / interval,
        "agents": agents,
        "ranks": ranks,
        "acked": acked,
        "failed": sum(a["failed"] for a in ok),
        "window_s": window,
        "asked_interval_s": asked,
        "central_takes_per_s": config.ingest_forwards_per_s,
        "settle_s": max((a["settle_s"] for a in ok), default=0.0),
        "forwards_per_s": acked / window if window else None,
        "rank_entries_per_s": entries / window if window else None,
        "central_cpu_s": central_cpu_s,
        "central_cpu_share": None if central_cpu_s is None or not phase else central_cpu_s / phase,
        "central_served": served,
        "central_idle_share": idle_share,
        "central_us_per_forward": None if busy is None or not served else 1e6 * busy / served,
        "clients_cpu_s": sum(a["client_cpu_s"] for a in ok),
        "latency_p50_s": max((a["latency_p50_s"] or 0.0 for a in ok), default=None),
        "latency_p99_s": max((a["latency_p99_s"] or 0.0 for a in ok), default=None),
        "errors": _errors(answers),
    }
    us = result["central_us_per_forward"]
    result["central_capacity_forwards_per_s"] = None if not us else 1e6 / us
    return result
