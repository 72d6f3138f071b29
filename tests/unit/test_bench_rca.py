"""bench.rca runs in quick mode and names the hang culprit."""

from __future__ import annotations

import json
from pathlib import Path

from bench import rca


def test_quick_run_writes_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rca.json"
    assert rca.main(["--quick", "--sizes", "32", "--replicas", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(r["culprit_named"] for r in data["rca"])
    assert data["false_alarms"][0]["detector"] == "predictor"
    assert "named" in capsys.readouterr().out
