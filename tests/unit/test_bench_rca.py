"""bench.rca in quick mode: names the hang culprit, measures gRPC ingest, scores culprits."""

from __future__ import annotations

import json
from pathlib import Path

from fthsdp.bench import rca


def test_quick_run_writes_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rca.json"
    assert rca.main(["--quick", "--sizes", "32", "--replicas", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(r["culprit_named"] for r in data["rca"])
    assert data["false_alarms"][0]["detector"] == "predictor"
    wire = data["grpc_ingest"]
    # Counted from the service's acknowledgements, and the service agrees with the count.
    assert wire["records"] > 0 and wire["failed_batches"] == 0
    assert wire["service_counted_records"] == wire["records"]
    assert wire["records"] == wire["batches"] * wire["batch"]
    assert 0 < wire["latency_p50_s"] <= wire["latency_p99_s"]
    assert wire["in_process"]["direct_records_per_s"] > 0
    culprits = {row["kind"]: row for row in data["culprits"]}
    assert set(culprits) == {"kill", "hang", "slow_rank", "fail_slow", "sdc", "all"}
    assert culprits["all"]["injected"] == sum(
        row["injected"] for kind, row in culprits.items() if kind != "all"
    )
    assert culprits["kill"]["named"] + culprits["kill"]["missed"] == culprits["kill"]["injected"]
    assert "named" in capsys.readouterr().out
