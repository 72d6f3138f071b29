"""bench.rca's pure parts, on the virtual clock and without the wire: the hang RCA names the rank
the emulator hung (after the hang timeout, with every other rank waiting on it), the false-alarm
rows count the replica-steps they ran, the tables render exact figures, and `main` wires its flags
into the runs and writes the documented JSON. The real gRPC ingest run (spawned clients, a real
HealthProcess) is in tests/integration/test_bench_rca.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from fthsdp.bench import faults, rca, wire
from fthsdp.bench.emulation import replica_name

# The hang detector's verdict on a rank that never entered its replica's collective.
VERDICT = re.compile(
    r"rank (?P<rank>\d+) of replica (?P<replica>\S+) never entered (?P<op>\w+) #(?P<seq>\d+) "
    r"of group (?P<group>\S+) \(open (?P<open_s>[\d.]+) s; (?P<waiting>\d+) ranks in "
    r"(?P<blocked>\d+) collectives wait on it\)"
)
RECORDS_PER_RANK_STEP = 4  # intra collective, ring collective, step record, heartbeat
RCA_KEYS = {
    "replicas": int,
    "ranks_per_replica": int,
    "ranks": int,
    "records": int,
    "generate_s": float,
    "ingest_s": float,
    "ingest_records_per_s": float,
    "rca_s": float,
    "incidents": int,
    "culprit_named": bool,
    "summary": str,
}


@pytest.mark.parametrize(("replicas", "ranks"), [(4, 32), (3, 8), (2, 64), (5, 5)])
def test_the_hang_verdict_names_the_hung_rank_after_the_timeout(replicas: int, ranks: int) -> None:
    result = rca.rca(replicas, ranks)
    assert {k: type(v) for k, v in result.items()} == RCA_KEYS
    assert (result["replicas"], result["ranks_per_replica"]) == (replicas, ranks)
    assert result["ranks"] == replicas * ranks
    # rca() hangs rank ranks // 3 of replica replicas // 2 at step 2: one incident, that rank.
    assert result["incidents"] == 1
    assert result["culprit_named"] is True
    verdict = VERDICT.fullmatch(result["summary"])
    assert verdict is not None, result["summary"]
    culprit = replica_name(replicas // 2)
    assert verdict["replica"] == culprit
    assert int(verdict["rank"]) == ranks // 3
    assert verdict["group"] == f"replica:{culprit}"  # its own replica's collective, not a ring
    assert int(verdict["seq"]) == 2  # the collective of the step the fault starts at
    # Not before the timeout: a hang verdict earlier than that would accuse a slow rank.
    assert float(verdict["open_s"]) >= rca.HANG_TIMEOUT_S
    assert int(verdict["waiting"]) == replicas * ranks - 1  # everyone else is blocked on it
    # Two whole healthy steps of every rank were ingested before the blocked one.
    assert result["records"] > 2 * RECORDS_PER_RANK_STEP * replicas * ranks
    for key in ("generate_s", "ingest_s", "rca_s", "ingest_records_per_s"):
        assert math.isfinite(result[key]) and result[key] > 0, key


@pytest.mark.parametrize(
    ("use_predictor", "detector"), [(True, "predictor"), (False, "plain change point")]
)
def test_false_alarm_rows_count_the_replica_steps_they_ran(
    use_predictor: bool, detector: str
) -> None:
    row = rca.false_alarms(use_predictor, seeds=2, steps=150, replicas=4)
    assert set(row) == {"detector", "alarms", "replica_steps", "per_1000_steps"}
    assert row["detector"] == detector
    assert row["replica_steps"] == 2 * 150 * 4
    assert isinstance(row["alarms"], int) and row["alarms"] >= 0
    assert row["per_1000_steps"] == 1000 * row["alarms"] / 1200
    if use_predictor:
        assert row["alarms"] == 0  # the benign workload fools only the plain detector


def _score(kind: str, injected: int, named: int, wrong: int, incidents: int) -> faults.KindScore:
    return faults.KindScore(
        kind=kind,
        injected=injected,
        named=named,
        missed=injected - named,
        incidents=incidents,
        wrong=wrong,
    )


def test_the_culprit_table_renders_each_kind_with_precision_and_recall(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rca.print_culprits([_score("kill", 4, 3, 1, 4), _score("all", 4, 3, 1, 4)])
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    assert header == [
        "fault", "kind", "injected", "named", "wrong", "missed", "incidents", "precision", "recall",
    ]  # fmt: skip
    # precision: 1 - 1/4 wrong incidents; recall: 3 of 4 named.
    assert lines[2].split() == ["kill", "4", "3", "1", "1", "4", "0.750", "0.750"]
    assert lines[3].split() == ["all", "4", "3", "1", "1", "4", "0.750", "0.750"]


def test_a_kind_without_incidents_has_precision_one() -> None:
    score = _score("sdc", 2, 0, 0, 0)
    assert score.to_dict() == {
        "kind": "sdc",
        "injected": 2,
        "named": 0,
        "wrong": 0,
        "missed": 2,
        "incidents": 0,
        "precision": 1.0,
        "recall": 0.0,
    }


def _ingest_result(exhausted: int = 0) -> dict[str, Any]:
    return {
        "clients": 2,
        "batch": 512,
        "duration_s": 1.0,
        "stream_records": 4096,
        "service": "central HealthProcess",
        "window_s": 2.0,
        "records": 40_960,
        "batches": 80,
        "failed_batches": 0,
        "service_counted_records": 40_960,
        "incidents": 0,
        "exhausted_clients": exhausted,
        "records_per_s": 20_480.0,
        "batches_per_s": 40.0,
        "latency_p50_s": 0.0125,
        "latency_p99_s": 0.25,
        "in_process": {
            "records": 20_480,
            "batches": 40,
            "direct_records_per_s": 81_920.0,
            "direct_batches_per_s": 160.0,
            "decoded_records_per_s": 40_960.0,
            "decoded_batches_per_s": 80.0,
        },
        "wire_vs_core": 0.25,
        "wire_vs_decoded_core": 0.5,
    }


def test_the_ingest_table_renders_rates_latencies_and_ratios_to_the_direct_core(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rca.print_ingest(_ingest_result(), rca_rate=12_345.6)
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:58].strip(): line[58:].split() for line in lines[2:5]}
    assert rows == {
        "gRPC Report -> central HealthProcess, K=2 clients": [
            "20,480", "40.0", "12.5ms", "250.0ms", "0.25x",
        ],
        "protobuf decode + HealthCore, in-process (no network)": [
            "40,960", "80.0", "-", "-", "0.50x",
        ],
        "HealthCore, in-process": ["81,920", "160.0", "-", "-", "1.00x"],
    }  # fmt: skip
    assert lines[5] == (
        "acknowledged 40,960 records in 80 batches over 2.00 s (service's own counter: 40,960; "
        "failed batches: 0; incidents: 0)"
    )
    assert lines[-1] == "RCA table's HealthCore ingest (whole steps, with evaluate): 12,346 rec/s"
    assert not any("WARNING" in line for line in lines)


def test_the_ingest_table_warns_when_clients_ran_out_of_records(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rca.print_ingest(_ingest_result(exhausted=1), rca_rate=None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "WARNING: 1 client(s) ran out of records before the end"
    assert not any(line.startswith("RCA table's") for line in lines)


def test_percentiles_pick_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert wire._percentile(values, 0.50) == 50.0
    assert wire._percentile(values, 0.99) == 99.0
    assert wire._percentile([7.0], 0.99) == 7.0
    assert math.isnan(wire._percentile([], 0.5))


def test_the_wire_summary_adds_up_the_clients() -> None:
    spec = wire.WireSpec(clients=2, batch=4, duration_s=1.0, stream_records=64)
    clients = [
        {
            "records": 12,
            "batches": 3,
            "failed": 0,
            "started": 100.0,
            "last_ack": 101.0,
            "exhausted": False,
            "latencies": [0.3, 0.1, 0.2],
        },
        {
            "records": 8,
            "batches": 2,
            "failed": 1,
            "started": 100.5,
            "last_ack": 102.0,
            "exhausted": True,
            "latencies": [0.4, 0.5],
        },
    ]
    summary = wire._summary(spec, clients, counted=20, incidents=1)
    assert summary == {
        "clients": 2,
        "batch": 4,
        "duration_s": 1.0,
        "stream_records": 64,
        "service": "central HealthProcess, thread of the benchmark process (own event loop)",
        "window_s": 2.0,  # first start to last acknowledgement, over every client
        "records": 20,
        "batches": 5,
        "failed_batches": 1,
        "service_counted_records": 20,
        "incidents": 1,
        "exhausted_clients": 1,
        "records_per_s": 10.0,
        "batches_per_s": 2.5,
        "latency_p50_s": 0.3,
        "latency_p99_s": 0.5,
    }


def test_main_wires_its_flags_into_the_runs_and_writes_the_documented_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[wire.WireSpec, int]] = []

    def fake_ingest(spec: wire.WireSpec, reference_records: int) -> dict[str, Any]:
        seen.append((spec, reference_records))
        return _ingest_result()

    monkeypatch.setattr(rca, "ingest", fake_ingest)
    out = tmp_path / "rca.json"
    argv = ["--quick", "--sizes", "8,16", "--replicas", "3", "--clients", "3", "--batch", "64"]
    assert rca.main([*argv, "--trials-per-kind", "1", "--json", str(out)]) == 0

    # --quick: a 1 s wire run against a 20,000-record in-process reference.
    assert seen == [(wire.WireSpec(clients=3, batch=64, duration_s=1.0), 20_000)]
    data = json.loads(out.read_text())
    assert set(data) == {"benchmark", "rca", "grpc_ingest", "false_alarms", "culprits"}
    assert data["benchmark"] == "rca"
    assert data["grpc_ingest"] == _ingest_result()
    assert [(r["replicas"], r["ranks_per_replica"], r["ranks"]) for r in data["rca"]] == [
        (3, 8, 24),
        (3, 16, 48),
    ]
    for row in data["rca"]:
        assert row["culprit_named"] is True and row["incidents"] == 1
        verdict = VERDICT.fullmatch(row["summary"])
        assert verdict is not None
        assert (verdict["replica"], int(verdict["rank"])) == (
            replica_name(1),
            row["ranks_per_replica"] // 3,
        )
    # --quick: one seed of 300 steps on 8 replicas per detector.
    assert [(a["detector"], a["replica_steps"]) for a in data["false_alarms"]] == [
        ("predictor", 2400),
        ("plain change point", 2400),
    ]
    culprits = {row["kind"]: row for row in data["culprits"]}
    assert list(culprits) == ["kill", "hang", "slow_rank", "fail_slow", "sdc", "all"]
    assert all(row["injected"] == 1 for kind, row in culprits.items() if kind != "all")
    assert culprits["all"]["injected"] == 5
    # Unambiguous evidence: these culprits are always named, and nobody else is accused.
    for kind in ("kill", "hang", "sdc"):
        assert (culprits[kind]["named"], culprits[kind]["wrong"]) == (1, 0), kind
    for row in culprits.values():
        assert row["named"] + row["missed"] == row["injected"]
        assert row["recall"] == row["named"] / row["injected"]

    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines[1:3]]
    assert [(t[0], t[-1]) for t in table] == [("24", "named"), ("48", "named")]


@pytest.mark.parametrize(
    "argv", [["--replicas", "two"], ["--batch", "1.5"], ["--sizes"], ["--no-such-flag"]]
)
def test_main_rejects_bad_arguments(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rca, "rca", lambda *a: pytest.fail("ran despite bad arguments"))
    with pytest.raises(SystemExit) as exc:
        rca.main(argv)
    assert exc.value.code == 2
    assert "usage: python -m bench.rca" in capsys.readouterr().err
