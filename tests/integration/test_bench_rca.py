"""bench.rca end to end in quick mode, over the real wire: a central HealthProcess on port 0 in a
thread, K spawned client processes sending `Report` batches with the bearer token. The service's
own counter must agree with what the clients counted as acknowledged, every batch holds exactly B
records, and the RCA and culprit sections of the same JSON document name what was injected. No
timing bound is asserted: throughput on a shared machine is a measurement, not a property."""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import pytest

from fthsdp.bench import rca, wire
from fthsdp.bench.emulation import replica_name

REPLICAS, RANKS, CLIENTS, BATCH, TRIALS_PER_KIND = 4, 32, 2, 512, 2
KINDS = ["kill", "hang", "slow_rank", "fail_slow", "sdc"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One quick run of `python -m bench.rca` (the JSON document and what it printed)."""
    out = tmp_path_factory.mktemp("rca") / "rca.json"
    argv = ["--quick", "--sizes", str(RANKS), "--replicas", str(REPLICAS)]
    argv += ["--clients", str(CLIENTS), "--batch", str(BATCH)]
    argv += ["--trials-per-kind", str(TRIALS_PER_KIND), "--json", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert rca.main(argv) == 0
    return json.loads(out.read_text()), printed.getvalue()


def _finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def test_the_document_has_every_section(run: tuple[dict[str, Any], str]) -> None:
    data, _ = run
    assert set(data) == {"benchmark", "rca", "grpc_ingest", "false_alarms", "culprits"}
    assert data["benchmark"] == "rca"


def test_the_hang_is_pinned_on_the_rank_that_hung(run: tuple[dict[str, Any], str]) -> None:
    data, printed = run
    (row,) = data["rca"]
    assert (row["replicas"], row["ranks_per_replica"], row["ranks"]) == (
        REPLICAS,
        RANKS,
        REPLICAS * RANKS,
    )
    assert row["incidents"] == 1 and row["culprit_named"] is True
    culprit = replica_name(REPLICAS // 2)
    assert row["summary"].startswith(f"rank {RANKS // 3} of replica {culprit} never entered ")
    assert all(_finite(row[k]) and row[k] > 0 for k in ("ingest_s", "rca_s", "generate_s"))
    table_row = printed.splitlines()[1].split()
    assert (table_row[0], table_row[1], table_row[-1]) == (
        str(REPLICAS * RANKS),
        str(row["records"]),
        "named",
    )


def test_the_service_acknowledged_every_record_the_clients_counted(
    run: tuple[dict[str, Any], str],
) -> None:
    data, _ = run
    g = data["grpc_ingest"]
    assert (g["clients"], g["batch"], g["duration_s"]) == (CLIENTS, BATCH, 1.0)
    assert g["failed_batches"] == 0
    assert g["batches"] > 0
    # Acknowledged by ReportResponse.accepted, cross-checked with the service's own counter.
    assert g["service_counted_records"] == g["records"]
    assert g["records"] == g["batches"] * BATCH  # whole batches only, every one accepted
    # A client sends at most the stream it emulated beforehand; one that ran out sent all of it.
    steps = max(1, math.ceil(g["stream_records"] / wire.records_per_step()))
    per_client = (steps * wire.records_per_step() // BATCH) * BATCH
    assert 0 <= g["exhausted_clients"] <= CLIENTS
    assert g["records"] <= CLIENTS * per_client
    if g["exhausted_clients"] == CLIENTS:
        assert g["records"] == CLIENTS * per_client
    assert isinstance(g["incidents"], int) and g["incidents"] >= 0


def test_rates_and_latencies_are_consistent(run: tuple[dict[str, Any], str]) -> None:
    data, _ = run
    g = data["grpc_ingest"]
    assert _finite(g["window_s"]) and g["window_s"] > 0
    assert g["records_per_s"] == pytest.approx(g["records"] / g["window_s"])
    assert g["batches_per_s"] == pytest.approx(g["batches"] / g["window_s"])
    assert _finite(g["latency_p50_s"]) and _finite(g["latency_p99_s"])
    assert 0 < g["latency_p50_s"] <= g["latency_p99_s"]
    ref = g["in_process"]
    # --quick: a 20,000-record reference, in whole batches of B.
    steps = math.ceil(20_000 / wire.records_per_step())
    assert ref["batches"] == steps * wire.records_per_step() // BATCH
    assert ref["records"] == ref["batches"] * BATCH
    for key in ("direct", "decoded"):
        rate, batches = ref[f"{key}_records_per_s"], ref[f"{key}_batches_per_s"]
        assert _finite(rate) and rate > 0
        assert rate == pytest.approx(batches * BATCH)
    assert g["wire_vs_core"] == pytest.approx(g["records_per_s"] / ref["direct_records_per_s"])
    assert g["wire_vs_decoded_core"] == pytest.approx(
        g["records_per_s"] / ref["decoded_records_per_s"]
    )


def test_false_alarms_and_culprits_count_what_was_run(run: tuple[dict[str, Any], str]) -> None:
    data, printed = run
    assert [(a["detector"], a["replica_steps"]) for a in data["false_alarms"]] == [
        ("predictor", 2400),
        ("plain change point", 2400),
    ]
    assert data["false_alarms"][0]["alarms"] == 0
    culprits = {row["kind"]: row for row in data["culprits"]}
    assert list(culprits) == [*KINDS, "all"]
    assert [culprits[k]["injected"] for k in KINDS] == [TRIALS_PER_KIND] * len(KINDS)
    for field in ("injected", "named", "wrong", "missed", "incidents"):
        assert culprits["all"][field] == sum(culprits[k][field] for k in KINDS), field
    for kind in ("kill", "hang", "sdc"):
        assert culprits[kind]["named"] == TRIALS_PER_KIND and culprits[kind]["wrong"] == 0
    for row in culprits.values():
        assert row["named"] + row["missed"] == row["injected"]
        assert row["recall"] == pytest.approx(row["named"] / row["injected"])
        assert 0.0 <= row["precision"] <= 1.0
    table = {line.split()[0]: line.split()[1:] for line in printed.splitlines()[-9:-2]}
    assert table["all"][:2] == [str(len(KINDS) * TRIALS_PER_KIND), str(culprits["all"]["named"])]
