"""bench.scale end to end at 3 replicas x 4 ranks, against the real services in their own
processes (the quorum service, the central health service), real gRPC with the bearer token,
spawned client processes and the real node agent of the victim's host.

One rank of replica-001 dies: its agent must report it, the service evict replica-001 and no
other, each surviving leader hold one new quorum of the two survivors, and every surviving rank
hold exactly the neighbours of that ring (in a ring of two, the other replica's rank of the same
index on both sides). The stages must come in causal order. Then every live host's agent
forwards its node state, and the hung rank of the RCA phase is named. No timing bound is
asserted: on a shared machine durations are measurements, not properties."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from fthsdp.bench import scale
from fthsdp.bench.emulation import replica_name
from fthsdp.bench.scale_model import Shape, endpoint

SHAPE = Shape(replicas=3, ranks=4, ranks_per_host=2)
ROUNDS = 3
VICTIM, VICTIM_RANK = 1, 2  # scale_model.victims: the middle replica, rank 1 + (4 // 3) % 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One run of `python -m bench.scale` (the JSON document and the table it printed)."""
    out: Path = tmp_path_factory.mktemp("scale") / "scale.json"
    argv = ["--shape", "3x4", "--hosts-per", "2", "--failures", "1", "--rounds", str(ROUNDS)]
    argv += ["--ingest-s", "1", "--hang-timeout-s", "1", "--detail", "--json", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert scale.main(argv) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_every_leader_joined_and_watches(run: tuple[dict[str, Any], str]) -> None:
    data, _ = run
    setup = data["setup"]
    assert (setup["joined"], setup["join_errors"]) == (3, [])
    assert setup["streams_live"] == setup["streams_total"] == 3  # one per replica, not per rank
    assert setup["agent_streams_live"] == setup["agent_streams_total"] == 6  # one per host
    relay = data["relay"]
    assert relay["depth"] == 1 and 0 < relay["hop_s_p50"] <= relay["hop_s_p99"]
    assert data["incomplete"] == []


def test_the_rounds_are_full_rounds_of_every_leader(run: tuple[dict[str, Any], str]) -> None:
    data, _ = run
    r = data["rounds"]
    assert (r["leaders"], r["rounds"]) == (3, ROUNDS)
    assert len(r["server_ms"]) == len(r["client_ms"]) == ROUNDS  # one full round per step
    assert r["first"]["responses"] == 3
    assert r["bytes_per_round"] == 3 * r["bytes_per_response"]
    # The first answer ships every rank's endpoints, the steady ones none.
    assert r["first"]["bytes"] / 3 > r["bytes_per_response"] + SHAPE.ranks * 3 * 20
    assert r["errors"] == [] and r["foreign_evictions"] == []


def test_the_dead_rank_takes_only_its_replica_out(run: tuple[dict[str, Any], str]) -> None:
    data, _ = run
    (f,) = data["failures"]
    assert f["victim"] == {"replica_id": replica_name(VICTIM), "rank": VICTIM_RANK}
    assert f["reports_before_death"] == 0
    outcomes = [(r[2], r[3]) for r in f["reports"]]
    assert outcomes[0] == (replica_name(VICTIM), "evicted")  # the agent's report evicted it
    assert {o for _, o in outcomes[1:]} <= {"deduplicated", "already_gone"}
    assert f["foreign_evictions"] == [] and f["errors"] == []
    assert f["via_exchange_timeout"] == 0  # every rank heard it on its Watch stream
    assert all(s["complete"] and s["done"] == s["total"] for s in f["stages"])
    # ... the last: the victim's two hosts' agents heard it on their own (filtered) streams
    assert [s["total"] for s in f["stages"]] == [1, 8, 2, 2, 2, 8, 2]
    assert f["agent_messages"] == 2  # its eviction, to its two agents only
    assert f["epochs"] == 1  # both survivors asked in time: one quorum leaves it out


def test_every_survivor_holds_the_new_ring_with_the_right_neighbours(
    run: tuple[dict[str, Any], str],
) -> None:
    data, _ = run
    (f,) = data["failures"]
    survivors = {int(k): v for k, v in f["replicas"].items()}
    assert sorted(survivors) == [0, 2]
    assert len(f["quorum_ids"]) == 1  # one new quorum, held by both
    for replica, outcome in survivors.items():
        assert outcome["ring"] == [replica_name(0), replica_name(2)]
        assert outcome["leader_at"] is not None and None not in outcome["ring_at"]
        other = 2 - replica
        expected = [
            [endpoint(SHAPE, other, i).ftar, endpoint(SHAPE, other, i).ftar]
            for i in range(SHAPE.ranks)
        ]
        assert outcome["neighbours"] == expected
        assert outcome["wrong_neighbours"] == 0


def test_the_stages_come_in_causal_order(run: tuple[dict[str, Any], str]) -> None:
    data, _ = run
    (f,) = data["failures"]
    at = {s["name"]: s["seconds"] for s in f["stages"]}
    assert 0 < f["detected_s"] <= at["evicted"]  # silence found, then the eviction
    assert at["evicted"] <= at["ranks notified"] <= at["replicas voted"]
    assert at["replicas voted"] <= at["leaders left it out"] <= at["leaders hold quorum"]
    assert at["leaders hold quorum"] <= at["ranks hold ring"]
    for outcome in f["replicas"].values():
        # A replica votes no once its last rank aborted, its leader asks only after the vote,
        # and its ranks derive their ring only from the leader's answer.
        assert outcome["voted_at"] == max(outcome["aborted"])
        assert outcome["voted_at"] <= outcome["leader_at"] <= min(outcome["ring_at"])


def test_every_live_agent_forwarded_its_node_state(run: tuple[dict[str, Any], str]) -> None:
    data, _ = run
    g = data["ingest"]
    # Six hosts of two ranks; the victim's replica is gone: four agents of two ranks forward.
    assert (g["agents"], g["ranks"]) == (4, 8)
    assert g["failed"] == 0 and g["acked"] > 0
    assert g["rank_entries_per_s"] == pytest.approx(2 * g["forwards_per_s"])
    assert g["needed_forwards_per_s"] == 20.0 and g["needed_beats_per_s"] == 40.0


def test_the_hung_rank_is_named_over_the_wire(run: tuple[dict[str, Any], str]) -> None:
    data, printed = run
    r = data["rca"]
    assert r["culprit"] == {"replica_id": replica_name(0), "rank": SHAPE.ranks // 3}
    assert r["named"] is True and r["incidents"] == {"hang": 1}, r["incident_list"]
    assert r["acked_batches"] == r["batches"] and r["failed_batches"] == 0
    assert f"culprit {replica_name(0)}:1 named in an evaluate of" in printed


def test_the_table_has_the_failure_column_and_nothing_short(
    run: tuple[dict[str, Any], str],
) -> None:
    data, printed = run
    assert f"#1 {replica_name(VICTIM)}:{VICTIM_RANK}" in printed
    assert "did not complete" not in printed
    assert set(data["processes"]) == {"quorum", "central", "client-0", "client-1"}
    assert all(p["rss_peak_bytes"] for p in data["processes"].values())
