"""The demo's PNG: loss per replica over steps, and healthy replicas over time, with every
injected failure marked on both, its recovery shaded (the failure until its victim is healthy
again) and the end phase (no more failures; every replica stops at one agreed step) marked.

A replica's loss line is broken where it skipped steps (down, or catching up from its peers):
drawing it across the outage would show losses nobody trained. Labels sit inside the plot
area, so a crowded or tall title never pushes them off the figure.

It draws on a bare `matplotlib.figure.Figure` with the Agg canvas rather than through pyplot: no
global figure registry, no GUI backend chosen from the environment, and safe to call from any
thread of the launcher."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fthsdp.deploy.demo.events import RunLog
from fthsdp.deploy.demo.report import analyse, build_report

_MODE_COLORS = {"process": "tab:red", "replica": "tab:purple", "hang": "tab:orange"}
RECOVERY_GID = "recovery"
"""`gid` of each shaded recovery interval (one per failure and panel)."""
END_PHASE_GID = "end-phase"
"""`gid` of the end phase's shading (one per panel)."""
LABEL_GID = "failure-label"
"""`gid` of the text naming a failure or the end phase."""
_LABEL_Y = 0.98
"""Labels hang from just below the top of the plot area (axes fraction)."""
_EDGE = 0.9
"""A label whose line is further right than this fraction of the x range goes left of it."""


def _as_report(source: Mapping[str, Any] | RunLog | str | Path) -> Mapping[str, Any]:
    if isinstance(source, RunLog):
        return analyse(source)
    if isinstance(source, str | Path):
        return build_report(source)
    if "series" not in source or "failures" not in source:
        raise ValueError("report lacks 'series' or 'failures'; pass a build_report() result")
    return source


def broken_line(points: Sequence[Sequence[float]]) -> tuple[list[float], list[float]]:
    """Steps and losses of `[step, loss]` points with a NaN loss between two points that are not
    consecutive steps (skipped steps, or a rollback), so the line stops there."""
    steps: list[float] = []
    losses: list[float] = []
    for point in points:
        step, loss = float(point[0]), float(point[1])
        if steps and step != steps[-1] + 1:
            steps.append((steps[-1] + step) / 2)
            losses.append(math.nan)
        steps.append(step)
        losses.append(loss)
    return steps, losses


def _label(ax: Axes, x: float, text: str, color: str) -> None:
    """A vertical label next to the line at x, inside the plot area."""
    low, high = ax.get_xlim()
    right = high > low and (x - low) / (high - low) > _EDGE
    ax.annotate(
        text,
        xy=(x, _LABEL_Y),
        xycoords=("data", "axes fraction"),
        xytext=(-2 if right else 2, 0),
        textcoords="offset points",
        rotation=90,
        fontsize=7,
        va="top",
        ha="right" if right else "left",
        color=color,
        gid=LABEL_GID,
    )


def _shade(ax: Axes, start: float, end: float, color: str, gid: str, alpha: float) -> None:
    ax.axvspan(start, max(start, end), color=color, alpha=alpha, linewidth=0, gid=gid)


def _loss_panel(ax: Axes, report: Mapping[str, Any]) -> None:
    series, failures = report["series"], report["failures"]
    last = 0.0
    for replica, points in sorted(series["loss"].items()):
        if points:
            steps, losses = broken_line(points)
            ax.plot(steps, losses, label=replica, linewidth=1.2)
            last = max(last, steps[-1])
    for failure in failures:
        color = _MODE_COLORS.get(failure["mode"], "tab:gray")
        ax.axvline(failure["step"], color=color, linestyle="--", linewidth=0.9, alpha=0.8)
        healthy = failure.get("healthy_step")
        end = max(last, failure["step"]) if healthy is None else healthy
        _shade(ax, failure["step"], end, color, RECOVERY_GID, 0.12)
    phase = report.get("end_phase")
    if phase is not None:
        _shade(ax, phase["step"], max(last, phase["step"]), "tab:gray", END_PHASE_GID, 0.15)
    # Labels last: their side depends on the final x range.
    for failure in failures:
        color = _MODE_COLORS.get(failure["mode"], "tab:gray")
        name = " ".join(str(part) for part in (failure["mode"], failure["replica"]) if part)
        _label(ax, failure["step"], name, color)
    if phase is not None:
        _label(ax, phase["step"], "end phase", "dimgray")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss per replica (dashed: injected failures; shaded: until healthy again)")
    if ax.lines and series["loss"]:
        ax.legend(loc="lower left", fontsize=8)  # labels hang from the top
    ax.grid(alpha=0.3)


def _healthy_panel(ax: Axes, report: Mapping[str, Any]) -> None:
    healthy, failures = report["series"]["healthy"], report["failures"]
    times = [p[0] for p in healthy]
    end = report.get("summary", {}).get("wall_time_s") or (times[-1] if times else 0.0)
    if healthy:
        counts = [p[1] for p in healthy]
        # Extend the last level to the end of the run so the final state is visible.
        ax.step([*times, max(end, times[-1])], [*counts, counts[-1]], where="post")
    for failure in failures:
        color = _MODE_COLORS.get(failure["mode"], "tab:gray")
        ax.axvline(failure["t"], color=color, linestyle="--", linewidth=0.9, alpha=0.8)
        took = failure.get("time_to_healthy_s")
        until = end if took is None else failure["t"] + took
        _shade(ax, failure["t"], until, color, RECOVERY_GID, 0.12)
    phase = report.get("end_phase")
    if phase is not None:
        _shade(ax, phase["t"], end, "tab:gray", END_PHASE_GID, 0.15)
        _label(ax, phase["t"], "end phase", "dimgray")
    total = (report.get("run") or {}).get("total_replicas")
    if total:
        ax.set_ylim(-0.2, total + 0.5)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("healthy replicas")
    ax.set_title("Healthy replicas per quorum")
    ax.grid(alpha=0.3)


def render_plot(source: Mapping[str, Any] | RunLog | str | Path) -> Figure:
    """The two-panel figure (loss per step above, healthy replicas over time below) for a
    report (from `build_report`), a loaded `RunLog`, or a run directory."""
    report = _as_report(source)
    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, healthy_ax = fig.subplots(2, 1)
    _loss_panel(loss_ax, report)
    _healthy_panel(healthy_ax, report)
    return fig


def write_plot(source: Mapping[str, Any] | RunLog | str | Path, path_png: str | Path) -> Path:
    """Write the two-panel PNG (`render_plot`) for a report, a loaded `RunLog`, or a run
    directory. Returns the path written."""
    path = Path(path_png)
    render_plot(source).savefig(path, format="png")
    return path
