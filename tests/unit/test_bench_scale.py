"""bench.scale's pure parts: the shape on the command line (and its clear refusals), the emulated
ranks' names, endpoints and ring neighbours, the victims, the arithmetic of stages that may not
complete before their deadline, each phase's figures from the clients' answers, and the table.
The run against the real services is tests/integration/test_bench_scale.py."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from fthsdp.bench import scale
from fthsdp.bench.emulation import EmulatedJob, replica_name
from fthsdp.bench.scale_agents import Plans
from fthsdp.bench.scale_model import (
    MAX_RANKS,
    Shape,
    Victim,
    client_replicas,
    endpoint,
    endpoints,
    host_of,
    neighbours,
    parse_shape,
    percentile,
    ring_order,
    rounds_of,
    stage,
    victims,
)
from fthsdp.bench.scale_phases import failure_result, ingest_result, rounds_result, setup_result
from fthsdp.bench.scale_render import render
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.quorum import core
from fthsdp.services.quorum.domain import Member, Quorum

# ---- the shape --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "replicas", "ranks"),
    [("12x8192", 12, 8192), ("1536X64", 1536, 64), (" 4 x 16 ", 4, 16), ("2×1", 2, 1)],
)
def test_a_shape_is_replicas_by_ranks(text: str, replicas: int, ranks: int) -> None:
    shape = parse_shape(text)
    assert (shape.replicas, shape.ranks, shape.ranks_per_host) == (replicas, ranks, 8)
    assert shape.total_ranks == replicas * ranks
    assert shape.label() == f"{replicas}x{ranks}"


@pytest.mark.parametrize("text", ["12-8192", "x8", "12x", "abc", "12x8192x2", "", "-2x4", "2.5x4"])
def test_a_malformed_shape_is_refused_with_an_example(text: str) -> None:
    with pytest.raises(ValueError, match=r"REPLICASxRANKS with positive integers, e\.g\. 12x8192"):
        parse_shape(text)


@pytest.mark.parametrize(
    ("text", "per_host", "message"),
    [
        ("1x4", 8, "at least 2 replicas \\(one dies\\), got 1"),
        ("0x4", 8, "at least 2 replicas"),
        ("4x0", 8, "at least 1 rank, got 0"),
        ("4x16", 0, "ranks per host must be >= 1, got 0"),
        (f"2x{MAX_RANKS}", 8, f"2 x {MAX_RANKS} = {2 * MAX_RANKS:,} ranks is more than"),
    ],
)
def test_a_shape_that_cannot_run_says_why(text: str, per_host: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_shape(text, per_host)


def test_hosts_hold_ranks_per_host_and_the_last_one_the_rest() -> None:
    assert Shape(replicas=12, ranks=8192).hosts == 12_288
    ragged = Shape(replicas=3, ranks=10, ranks_per_host=8)
    assert (ragged.hosts_per_replica, ragged.hosts) == (2, 6)
    assert [host_of(1, i, 8) for i in (0, 7, 8, 9)] == ["host-001-0"] * 2 + ["host-001-1"] * 2


def test_hosts_are_named_as_the_emulated_job_names_them() -> None:
    # The health records of bench.emulation and the agents of bench.scale must name one host.
    job = EmulatedJob(replicas=3, ranks=10, sink=lambda now, records: None, ranks_per_host=4)
    assert job.hosts == [host_of(r, i, 4) for r in range(3) for i in range(10)]
    assert job.names == [replica_name(r) for r in range(3)]


def test_every_rank_has_its_own_endpoint_and_the_service_accepts_them() -> None:
    shape = Shape(replicas=5, ranks=33, ranks_per_host=8)
    every = [endpoint(shape, r, i) for r in range(5) for i in range(33)]
    assert len({e.ftar for e in every}) == 5 * 33
    # One checkpoint sidecar per host: 5 hosts per replica of 33 ranks, by 8.
    assert len({e.checkpoint for e in every}) == shape.hosts == 25
    for r in range(5):
        assert core.check_ranks(33, endpoints(shape, r)) == tuple(endpoints(shape, r))
    big = Shape(replicas=12, ranks=8192)
    assert endpoint(big, 11, 8191).ftar == "10.0.47.255:29507"  # host 12,287, 8th rank on it


def test_the_ring_is_in_replica_id_order_not_index_order() -> None:
    # replica-1000 sorts before replica-200: the service sorts members by id.
    assert ring_order([200, 1000, 999]) == [1000, 200, 999]
    shape = Shape(replicas=1001, ranks=2)
    left, right = neighbours(shape, [200, 1000, 999], 200, 1)
    assert (left, right) == (endpoint(shape, 1000, 1).ftar, endpoint(shape, 999, 1).ftar)
    assert neighbours(shape, [200, 1000, 999], 1000, 0) == (
        endpoint(shape, 999, 0).ftar,
        endpoint(shape, 200, 0).ftar,
    )
    alone = endpoint(shape, 7, 1).ftar
    assert neighbours(shape, [7], 7, 1) == (alone, alone)


def test_victims_are_distinct_replicas_and_never_a_leader_with_siblings() -> None:
    chosen = victims(Shape(replicas=12, ranks=8192), 5)
    assert [v.replica for v in chosen] == [6, 7, 8, 9, 10]
    assert all(0 < v.rank < 8192 for v in chosen)
    assert len({v.rank for v in chosen}) == 5
    assert victims(Shape(replicas=3, ranks=1), 2) == [
        Victim(replica=1, rank=0),
        Victim(replica=2, rank=0),
    ]
    assert victims(Shape(replicas=3, ranks=4), 0) == []
    for bad in (3, -1):
        with pytest.raises(ValueError, match=r"--failures must be in 0\.\.2"):
            victims(Shape(replicas=3, ranks=4), bad)


def test_client_processes_share_the_replicas_round_robin() -> None:
    shape = Shape(replicas=5, ranks=2)
    assert client_replicas(shape, 2) == [[0, 2, 4], [1, 3]]
    assert client_replicas(Shape(replicas=2, ranks=2), 4) == [[0], [1]]  # none left empty
    with pytest.raises(ValueError, match="--clients must be >= 1"):
        client_replicas(shape, 0)


# ---- stages -----------------------------------------------------------------------------------


def test_a_stage_completes_at_its_last_party() -> None:
    st = stage("ranks hold ring", 100.0, [100.2, 100.7, 100.5], 3, 60.0)
    assert st.complete and st.seconds == pytest.approx(0.7)
    assert (st.done, st.total) == (3, 3)
    assert st.describe() == "0.700 s"
    assert st.to_dict() == {
        "name": "ranks hold ring",
        "done": 3,
        "total": 3,
        "seconds": pytest.approx(0.7),
        "complete": True,
        "deadline_s": 60.0,
    }


def test_a_stage_short_of_parties_says_how_far_it_got() -> None:
    reached = [10.0 + k / 1000 for k in range(41_203)]
    st = stage("ranks hold ring", 0.0, [*reached, None, math.nan], 98_304, 60.0)
    assert not st.complete and st.seconds is None
    assert st.describe() == "41,203 / 98,304 after 60 s"
    # Late arrivals do not count, and a stage with nobody to reach never completes.
    late = stage("x", 0.0, [1.0, 61.0], 2, 60.0)
    assert (late.done, late.complete) == (1, False)
    assert stage("x", 0.0, [], 0, 60.0).complete is False


def test_percentiles_and_client_rounds() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(k) for k in range(100)], 0.99) == 98.0
    # Per step: last answer anywhere minus last request anywhere; steps a client lacks are cut.
    one = [(1.0, 1.5), (2.0, 2.4)]
    two = [(1.2, 1.3), (2.1, 2.9), (3.0, 3.1)]
    assert rounds_of([one, two]) == pytest.approx([0.3, 0.8])


# ---- phases -----------------------------------------------------------------------------------


def test_setup_counts_joins_and_live_streams_over_clients() -> None:
    shape = Shape(replicas=4, ranks=16)
    ok = {"joined": 2, "join_errors": [], "join_s": 0.1, "streams_total": 2, "setup_s": 2.0}
    answers = [
        {**ok, "streams_live": 2},
        {**ok, "joined": 1, "join_errors": ["replica-003: world_size"], "streams_total": 1,
         "streams_live": 0},
    ]  # fmt: skip
    result = setup_result(answers, shape, 240.0)
    assert (result["joined"], result["streams_live"], result["streams_total"]) == (3, 2, 3)
    assert result["incomplete"] == [
        "leaders joined: 3 / 4: replica-003: world_size",
        "leader Watch streams live: 2 / 3 after 240 s",
    ]


def _round_answer(steps: list[tuple[float, float]], leaders: int, data: int) -> dict[str, Any]:
    return {
        "steps": steps,
        "leaders": leaders,
        "errors": [],
        "foreign_evictions": [],
        "bytes": data,
        "responses": leaders * len(steps),
    }


def test_rounds_take_the_service_timings_of_full_rounds_and_count_bytes_per_round() -> None:
    first = [_round_answer([(0.0, 0.5)], 2, 2000), _round_answer([(0.1, 0.4)], 1, 1000)]
    steady = [
        _round_answer([(1.0, 1.01), (2.0, 2.03)], 2, 400),
        _round_answer([(1.005, 1.02), (2.0, 2.01)], 1, 200),
    ]
    timings = [(5, 3, 0.004), (6, 2, 0.5), (7, 3, 0.002)]  # round 6 lacked a leader: not full
    result = rounds_result(first, steady, timings, 0.05, 2)
    assert result["leaders"] == 3 and result["rounds"] == 2
    assert result["server_ms"] == pytest.approx([4.0, 2.0])
    assert result["client_ms"] == pytest.approx([15.0, 30.0])
    # The first round: the last answer (0.5) after the last request (0.1).
    assert result["first"] == {"client_s": pytest.approx(0.4), "bytes": 3000, "responses": 3}
    assert result["bytes_per_round"] == 300 and result["bytes_per_response"] == 100
    assert result["service_cpu_ms_per_round"] == pytest.approx(25.0)
    assert result["incomplete"] == []


def _survivor(at: float, ranks: int, *, ring: list[str], wrong: int = 0) -> dict[str, Any]:
    return {
        "leader_at": at + 0.2,
        "first_at": at + 0.15,
        "epochs": 1,
        "voted_at": at + 0.1,
        "quorum_id": 7,
        "ring": ring,
        "ranks": ranks,
        "aborted": [at + 0.05 * k for k in range(ranks)],
        "ring_at": [at + 0.3] * ranks,
        "via_timeout": 0,
        "errors": [],
        "wrong_neighbours": wrong,
        "neighbours": None,
    }


def test_a_failure_is_staged_from_the_death_and_early_reports_are_flagged() -> None:
    shape, victim, death = Shape(replicas=3, ranks=2), Victim(replica=1, rank=1), 100.0
    ring = [replica_name(0), replica_name(2)]
    answers = [
        {"first_seen": 100.74, "replicas": {0: _survivor(100.8, 2, ring=ring)},
         "foreign_evictions": [], "agents_heard": [100.76], "agent_messages": 1},
        {"first_seen": None, "replicas": {2: _survivor(100.9, 2, ring=ring)},
         "foreign_evictions": [], "agents_heard": [], "agent_messages": 0},
    ]  # fmt: skip
    reports = [
        (99.0, 99.1, "replica-001", "deduplicated"),
        (100.7, 100.75, "replica-001", "evicted"),
    ]
    f = failure_result(answers, victim, death, reports, [0, 2], shape, 60.0)
    seconds = {s["name"]: s["seconds"] for s in f["stages"]}
    # The eviction is the earliest sign of it: the first Watch event (before the report's answer).
    assert seconds == pytest.approx({
        "evicted": 0.74,
        "ranks notified": 0.95,
        "replicas voted": 1.0,
        "leaders left it out": 1.05,
        "leaders hold quorum": 1.1,
        "ranks hold ring": 1.2,
        "its agents heard it": 0.76,  # the victim's one host's agent, on its filtered stream
    })  # fmt: skip
    assert f["agent_messages"] == 1
    assert f["detected_s"] == pytest.approx(0.7) and f["report_answered_s"] == pytest.approx(0.75)
    assert f["reports_before_death"] == 1 and f["quorum_ids"] == [7] and f["ring_sizes"] == [2]
    assert f["epochs"] == 1
    assert f["incomplete"] == [
        "failure replica-001:1: its agent reported it 1 times before the rank died "
        "(its beats were late: a loaded machine)"
    ]


def test_a_failure_that_stalls_reports_each_stage_it_did_not_reach() -> None:
    shape, victim = Shape(replicas=3, ranks=2), Victim(replica=1, rank=1)
    stuck = _survivor(100.0, 2, ring=[replica_name(0), replica_name(1), replica_name(2)], wrong=2)
    stuck.update(leader_at=None, first_at=None, voted_at=None, ring_at=[None, None], epochs=0)
    answers = [
        {"first_seen": 100.8, "replicas": {0: stuck},
         "foreign_evictions": ["replica-002: no heartbeat for 1000 ms"]},
        {"error": "client-1: TimeoutError no answer in 90 s"},
    ]  # fmt: skip
    f = failure_result(answers, victim, 100.0, [], [0, 2], shape, 60.0)
    by_name = {s["name"]: s for s in f["stages"]}
    assert by_name["evicted"]["complete"] and by_name["ranks notified"]["done"] == 2
    assert [s["complete"] for s in f["stages"]] == [True] + [False] * 6
    assert f["incomplete"] == [
        "failure replica-001:1: client-1: TimeoutError no answer in 90 s",
        "failure replica-001:1: ranks notified: 2 / 4 after 60 s",
        "failure replica-001:1: replicas voted: 0 / 2 after 60 s",
        "failure replica-001:1: leaders left it out: 0 / 2 after 60 s",
        "failure replica-001:1: leaders hold quorum: 0 / 2 after 60 s",
        "failure replica-001:1: ranks hold ring: 0 / 4 after 60 s",
        "failure replica-001:1: its agents heard it: 0 / 1 after 60 s",
        "failure replica-001:1: 1 healthy replicas evicted meanwhile, e.g. replica-002: no "
        "heartbeat for 1000 ms",
        "failure replica-001:1: 2 ranks hold a wrong ring",
    ]


def test_ingest_needs_every_forward_and_prices_the_central_cpu() -> None:
    answer = {
        "agents": 10, "ranks": 80, "acked": 200, "failed": 3, "rank_entries": 1600,
        "asked_interval_s": 0.0, "settle_s": 0.4, "window_s": 5.0, "phase_s": 5.0,
        "client_cpu_s": 1.5, "latency_p50_s": 0.01, "latency_p99_s": 0.2,
    }  # fmt: skip
    # The service completed 400 forwards, some after their sender had given up on them.
    g = ingest_result([answer, {**answer, "latency_p99_s": 0.4}], HealthConfig(), 2.0, 500)
    assert g["needed_beats_per_s"] == 800.0  # 160 ranks x 5/s
    assert g["needed_forwards_per_s"] == 100.0  # 20 agents x 5/s
    assert g["needed_rank_entries_per_s"] == 800.0
    assert (g["forwards_per_s"], g["rank_entries_per_s"]) == (80.0, 640.0)
    assert g["central_cpu_share"] == 0.4
    assert g["central_us_per_forward"] == 4000.0
    assert g["central_capacity_forwards_per_s"] == 250.0
    assert (g["failed"], g["latency_p99_s"]) == (6, 0.4)
    # Central asked for a forward every 2 s: that is what is needed, and the CPU share is over
    # the whole phase (the settling included).
    spaced = {**answer, "asked_interval_s": 2.0, "window_s": 4.0, "phase_s": 8.0}
    g = ingest_result([spaced, spaced], HealthConfig(), 2.0, 500)
    assert g["needed_forwards_per_s"] == 10.0  # 20 agents every 2 s
    assert g["needed_rank_entries_per_s"] == 80.0
    assert (g["forwards_per_s"], g["asked_interval_s"]) == (100.0, 2.0)
    assert g["central_cpu_share"] == 0.25


def test_the_plan_work_is_done_once_per_distinct_quorum() -> None:
    shape = Shape(replicas=3, ranks=2)
    members = tuple(
        Member(replica_id=replica_name(r), incarnation=1, step=3, ranks=tuple(endpoints(shape, r)))
        for r in range(3)
    )
    healthy = tuple(m.replica_id for m in members)
    quorum = Quorum(quorum_id=4, members=members, max_step=3, healthy=healthy)
    plans = Plans()
    a, b = (
        plans.payload(quorum, replica_name(0), None),
        plans.payload(quorum, replica_name(2), None),
    )
    assert a is b and len(plans.encode_s) == 1
    order, listed = plans.members(a, replica_name(0))
    assert order == {replica_name(r): r for r in range(3)}
    assert [m["ranks"][1][0] for m in listed] == [m.ranks[1].ftar for m in members]
    assert plans.members(a, replica_name(1))[0] is order and len(plans.decode_s) == 1
    assert plans.steady(None, a) is None and plans.steady(a, a) == 3


# ---- the table and the command line --------------------------------------------------------


def _document() -> dict[str, Any]:
    stages = [
        {"name": n, "done": d, "total": t, "seconds": s, "complete": s is not None,
         "deadline_s": 60.0}
        for n, d, t, s in (
            ("evicted", 1, 1, 0.752), ("ranks notified", 98_304 - 8192, 90_112, 12.5),
            ("replicas voted", 11, 11, 12.6), ("leaders left it out", 11, 11, 12.8),
            ("leaders hold quorum", 11, 11, 13.0),
            ("ranks hold ring", 41_203, 90_112, None), ("its agents heard it", 1024, 1024, 0.2),
        )
    ]  # fmt: skip
    return {
        "shape": {"replicas": 12, "ranks": 8192, "ranks_per_host": 8, "total_ranks": 98_304,
                  "hosts": 12_288},
        "settings": {"clients": 2},
        "machine": {"nproc": 2, "load_avg_start": [1.0, 1.0, 1.0], "load_avg_end": [2.0, 1.0, 1.0]},
        "wall_s": 412.0,
        "world_size_cap": {"cap": 4096, "lifted_in_the_service_process": True},
        "failures": [{"victim": {"replica_id": "replica-006", "rank": 2731}, "detected_s": 0.71,
                      "stages": stages, "via_exchange_timeout": 0, "wrong_neighbours": 0,
                      "ring_sizes": [11], "epochs": 2, "cpu_s": {"quorum": 31.2},
                      "agent_messages": 1024}],
        "processes": {"quorum": {"cpu_s": {"setup": 40.0}, "rss_peak_bytes": 2_500_000_000}},
        "incomplete": ["failure replica-006:2731: ranks hold ring: 41,203 / 90,112 after 60 s"],
    }  # fmt: skip


def test_the_table_shows_each_stage_the_cap_and_what_fell_short() -> None:
    text = render(_document())
    lines = text.splitlines()
    assert lines[0] == (
        "fthsdp control plane at scale: 12 replicas × 8,192 ranks = 98,304 ranks on 12,288 hosts "
        "of 8; 2 client processes"
    )
    assert (
        "world size 8192 is over the service's cap of 4096: lifted in the service process only"
        in lines
    )
    row = {line[:46].strip(): line[46:].split() for line in lines if line.startswith("  ")}
    assert row["agent found it dead (report sent)"] == ["0.710"]
    assert row["service evicts the replica"] == ["0.752"]
    assert row["every survivor has a quorum without it"] == ["12.800"]
    assert row["every survivor holds the full new quorum"] == ["13.000"]
    assert row["new ring size / quorums to reach it"] == ["11", "/", "2"]
    assert row["every surviving rank holds its new ring"] == ["41,203/90,112", "@60s", "≤", "0.7"]
    assert row["quorum service CPU s in the phase"] == ["31.2"]
    assert row["every node agent of its replica heard it"] == ["0.200"]
    assert row["events to agent streams (filtered)"] == ["1,024"]
    assert "  quorum service RSS peak 2,500.0 MB misses the ≤ 1 GB target" in lines
    assert lines[-2:] == [
        "did not complete / fell short:",
        "  failure replica-006:2731: ranks hold ring: 41,203 / 90,112 after 60 s",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shape", "12by8192"], "a shape is REPLICASxRANKS with positive integers"),
        (["--shape", "1x4"], "at least 2 replicas"),
        (["--shape", "3x4", "--failures", "3"], r"--failures must be in 0\.\.2"),
        (["--shape", "3x4", "--hosts-per", "0"], "ranks per host must be >= 1"),
        (["--shape", "3x4", "--rounds", "0"], "--rounds and --clients must be >= 1"),
        (["--shape", "3x4", "--stage-timeout-s", "0"], "--stage-timeout-s must be positive"),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        scale.parse_args(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)
