"""The generated code in protos/ must be exactly what scripts/gen_protos.sh produces today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_protos_match_sources(tmp_path: Path) -> None:
    sources = sorted((ROOT / "protos").glob("*.proto"))
    assert sources, "protos/ holds no .proto file"
    (tmp_path / "fthsdp" / "protos").mkdir(parents=True)
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)],
        cwd=ROOT,
        check=True,
        env={"PY": sys.executable, "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    generated = sorted(p.name for p in (tmp_path / "fthsdp" / "protos").iterdir())
    checked_in = sorted(
        p.name
        for p in (ROOT / "protos").iterdir()
        if p.name.split(".")[0].endswith(("_pb2", "_grpc"))
    )
    assert generated == checked_in
    for name in generated:
        expected = (tmp_path / "fthsdp" / "protos" / name).read_text()
        actual = (ROOT / "protos" / name).read_text()
        assert actual == expected, f"protos/{name} drifted: run `make protos`"
