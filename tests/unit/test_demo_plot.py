"""The demo plot renders from a report, a loaded log or a run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from fthsdp.deploy.demo.plot import write_plot
from fthsdp.deploy.demo.report import RunLog, build_report
from tests.unit.test_demo_report import SyntheticRun

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_writes_a_png_from_a_report(tmp_path: Path) -> None:
    run_dir = SyntheticRun(tmp_path / "run").write_until()
    out = write_plot(build_report(run_dir), tmp_path / "report.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000


def test_accepts_a_runlog_or_a_directory_even_mid_run(tmp_path: Path) -> None:
    run_dir = SyntheticRun(tmp_path / "run").write_until(1004.0)
    assert write_plot(RunLog.load(run_dir), tmp_path / "a.png").read_bytes().startswith(PNG_MAGIC)
    assert write_plot(run_dir, tmp_path / "b.png").read_bytes().startswith(PNG_MAGIC)


def test_rejects_a_dict_that_is_not_a_report(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="series"):
        write_plot({"summary": {}}, tmp_path / "x.png")
