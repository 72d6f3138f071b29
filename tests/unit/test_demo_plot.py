"""The demo plot renders from a report, a loaded log or a run directory; a down replica's loss
line is broken over its outage, every recovery and the end phase are shaded, and every label
stays inside its plot area."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from fthsdp.deploy.demo.events import RunLog
from fthsdp.deploy.demo.plot import (
    END_PHASE_GID,
    LABEL_GID,
    RECOVERY_GID,
    broken_line,
    render_plot,
    write_plot,
)
from fthsdp.deploy.demo.report import build_report
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


# ---- what the figure shows ----------------------------------------------------------------------


def _drawn(report: dict[str, Any]) -> tuple[Figure, Axes, Axes]:
    fig = render_plot(report)
    fig.canvas.draw()  # the layout and the text positions are final only once drawn
    loss_ax, healthy_ax = fig.axes[:2]
    return fig, loss_ax, healthy_ax


def _line(ax: Axes, replica: str) -> Line2D:
    return next(line for line in ax.get_lines() if line.get_label() == replica)


def _spans(ax: Axes, gid: str) -> list[tuple[float, float]]:
    """(x0, x1) in data coordinates of the patches tagged `gid`."""
    out = []
    for patch in ax.patches:
        if patch.get_gid() == gid:
            box = patch.get_path().get_extents(patch.get_patch_transform())
            out.append((round(box.x0, 6), round(box.x1, 6)))
    return sorted(out)


def test_the_victims_loss_line_breaks_over_its_outage(tmp_path: Path) -> None:
    report = build_report(SyntheticRun(tmp_path).write_until())
    (failure,) = report["failures"]
    assert (failure["replica"], failure["step"], failure["healthy_step"]) == ("r1", 4, 6)
    _, loss_ax, _ = _drawn(report)
    # r1 committed steps 0-3, was down for 4-5, caught up in 6 (no loss) and trained from 7.
    steps, losses = (list(map(float, data)) for data in _line(loss_ax, "r1").get_data())
    gaps = [s for s, loss in zip(steps, losses, strict=True) if math.isnan(loss)]
    assert len(gaps) == 1 and failure["step"] <= gaps[0] <= failure["healthy_step"]
    trained = [s for s, loss in zip(steps, losses, strict=True) if not math.isnan(loss)]
    assert trained == [0, 1, 2, 3, 7, 8, 9]
    # A survivor trained every step: one unbroken line.
    assert not any(math.isnan(float(v)) for v in _line(loss_ax, "r0").get_ydata())


def test_recoveries_and_the_end_phase_are_shaded(tmp_path: Path) -> None:
    report = build_report(SyntheticRun(tmp_path).write_until())
    # r1 killed at 4.5 s (step 4), healthy again 4.0 s later in step 6; no failure after: the end
    # phase starts then (the next failure slot, 20 s later, is past the end of the run).
    assert report["end_phase"] == {"t": 8.5, "step": 7}
    _, loss_ax, healthy_ax = _drawn(report)
    assert _spans(loss_ax, RECOVERY_GID) == [(4.0, 6.0)]
    assert _spans(healthy_ax, RECOVERY_GID) == [(4.5, 8.5)]
    assert _spans(loss_ax, END_PHASE_GID) == [(7.0, 9.0)]
    assert _spans(healthy_ax, END_PHASE_GID) == [(8.5, 12.0)]


def _report(failures: list[dict[str, Any]], end_phase: dict[str, Any] | None) -> dict[str, Any]:
    """A report with three replicas over 200 steps and 100 s; r1 down over steps 80-95."""
    loss = {r: [[s, 3.0 - s / 100] for s in range(200)] for r in ("r0", "r2")}
    loss["r1"] = [[s, 3.1 - s / 100] for s in range(200) if not 80 <= s <= 95]
    healthy = [[0.5, 3, 1], [40.2, 2, 2], [48.0, 3, 3]]
    return {
        "run": {"total_replicas": 3},
        "series": {"loss": loss, "healthy": healthy},
        "failures": failures,
        "end_phase": end_phase,
        "summary": {"wall_time_s": 100.0},
    }


def _failure(t: float, step: int, mode: str, took: float | None, healthy: int | None) -> Any:
    return {
        "t": t,
        "replica": "r1",
        "mode": mode,
        "step": step,
        "time_to_healthy_s": took,
        "healthy_step": healthy,
    }


def test_every_failure_gets_a_span_and_one_that_never_healed_runs_to_the_end() -> None:
    failures = [
        _failure(0.2, 0, "replica", 3.0, 4),
        _failure(40.0, 80, "hang", 8.0, 96),
        _failure(99.5, 199, "process", None, None),
    ]
    _, loss_ax, healthy_ax = _drawn(_report(failures, None))
    assert _spans(loss_ax, RECOVERY_GID) == [(0.0, 4.0), (80.0, 96.0), (199.0, 199.0)]
    assert _spans(healthy_ax, RECOVERY_GID) == [(0.2, 3.2), (40.0, 48.0), (99.5, 100.0)]
    assert _spans(loss_ax, END_PHASE_GID) == [] and _spans(healthy_ax, END_PHASE_GID) == []


def test_labels_stay_inside_the_plot_area_even_at_its_edges() -> None:
    # Failures at the first and the last step, a long label, and an end phase near the end:
    # the places where a label hanging from the top or beside its line would leave the axes.
    failures = [
        _failure(0.0, 0, "replica", 3.0, 4),
        _failure(40.0, 80, "hang", 8.0, 96),
        _failure(99.9, 199, "process", 0.05, 199),
    ]
    fig, loss_ax, healthy_ax = _drawn(_report(failures, {"t": 99.95, "step": 199}))
    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    labels = 0
    for ax in (loss_ax, healthy_ax):
        area = ax.get_window_extent(renderer)
        for text in ax.texts:
            if text.get_gid() != LABEL_GID:
                continue
            labels += 1
            box = text.get_window_extent(renderer)
            where = f"{text.get_text()!r} at {box.bounds} outside {area.bounds}"
            assert area.x0 <= box.x0 and box.x1 <= area.x1, where
            assert area.y0 <= box.y0 and box.y1 <= area.y1, where
            assert figure_box.contains(box.x0, box.y0) and figure_box.contains(box.x1, box.y1)
    assert labels == len(failures) + 2  # the end phase is named on both panels


def test_broken_line_breaks_at_skipped_steps_and_rollbacks_only() -> None:
    steps, losses = broken_line([[0, 3.0], [1, 2.9], [4, 2.6], [5, 2.5], [2, 2.8]])
    assert steps[:2] == [0.0, 1.0] and losses[:2] == [3.0, 2.9]
    assert steps[2] == 2.5 and math.isnan(losses[2])
    assert steps[3:5] == [4.0, 5.0]
    assert steps[5] == 3.5 and math.isnan(losses[5])
    assert steps[6:] == [2.0] and losses[6:] == [2.8]
    assert broken_line([]) == ([], [])
