"""The demo's PNG: loss per replica over steps, and healthy replicas over time, with every
injected failure marked on both.

It draws on a bare `matplotlib.figure.Figure` with the Agg canvas rather than through pyplot: no
global figure registry, no GUI backend chosen from the environment, and safe to call from any
thread of the launcher."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fthsdp.deploy.demo.report import RunLog, analyse, build_report

_MODE_COLORS = {"process": "tab:red", "replica": "tab:purple", "hang": "tab:orange"}


def _as_report(source: Mapping[str, Any] | RunLog | str | Path) -> Mapping[str, Any]:
    if isinstance(source, RunLog):
        return analyse(source)
    if isinstance(source, str | Path):
        return build_report(source)
    if "series" not in source or "failures" not in source:
        raise ValueError("report lacks 'series' or 'failures'; pass a build_report() result")
    return source


def write_plot(source: Mapping[str, Any] | RunLog | str | Path, path_png: str | Path) -> Path:
    """Write the two-panel PNG for a report (from `build_report`), a loaded `RunLog`, or a run
    directory. Returns the path written."""
    report = _as_report(source)
    series, failures = report["series"], report["failures"]
    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, healthy_ax = fig.subplots(2, 1)

    for replica, points in sorted(series["loss"].items()):
        if points:
            steps, losses = zip(*points, strict=True)
            loss_ax.plot(steps, losses, label=replica, linewidth=1.2)
    for failure in failures:
        color = _MODE_COLORS.get(failure["mode"], "tab:gray")
        loss_ax.axvline(failure["step"], color=color, linestyle="--", linewidth=0.9, alpha=0.8)
        loss_ax.annotate(
            f"{failure['mode']} {failure['replica']}",
            xy=(failure["step"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7,
            va="top",
            ha="right",
            color=color,
        )
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("training loss")
    loss_ax.set_title("Loss per replica (dashed: injected failures)")
    if loss_ax.lines and series["loss"]:
        loss_ax.legend(loc="upper right", fontsize=8)
    loss_ax.grid(alpha=0.3)

    healthy = series["healthy"]
    if healthy:
        times = [p[0] for p in healthy]
        counts = [p[1] for p in healthy]
        end = report.get("summary", {}).get("wall_time_s") or times[-1]
        # Extend the last level to the end of the run so the final state is visible.
        healthy_ax.step([*times, max(end, times[-1])], [*counts, counts[-1]], where="post")
    for failure in failures:
        color = _MODE_COLORS.get(failure["mode"], "tab:gray")
        healthy_ax.axvline(failure["t"], color=color, linestyle="--", linewidth=0.9, alpha=0.8)
    total = (report.get("run") or {}).get("total_replicas")
    if total:
        healthy_ax.set_ylim(-0.2, total + 0.5)
    healthy_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    healthy_ax.set_xlabel("seconds since start")
    healthy_ax.set_ylabel("healthy replicas")
    healthy_ax.set_title("Healthy replicas per quorum")
    healthy_ax.grid(alpha=0.3)

    path = Path(path_png)
    fig.savefig(path, format="png")
    return path
