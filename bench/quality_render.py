"""The summary, table and plot `bench.quality` makes of its result document (`quality.py`
measures): per run kind over seeds, the held-out loss at equal tokens and its paired difference
from fault-free, as a plain-text table and a PNG."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FAULT_FREE = "fault-free"
"""The run kind without failures, which every policy's run is compared with."""


# ---------------------------------------------------------------------------------------------
# Summary


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _paired(runs: dict[str, dict[str, Any]], name: str, key: str) -> dict[str, Any]:
    """`key` of run kind `name` over seeds and its per-seed difference from fault-free."""
    values = [r[name][key] for r in runs.values()]
    base = [r[FAULT_FREE][key] for r in runs.values()]
    deltas = [v - b for v, b in zip(values, base, strict=True)]
    return {
        "value": _spread(values),
        "delta": _spread(deltas),
        "delta_pct": _spread([100 * d / b for d, b in zip(deltas, base, strict=True)]),
        "fault_free_spread": max(base) - min(base),
    }


def summarize(runs: dict[str, dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Per run kind over seeds: final held-out loss (and its mean over the last quarter of the
    budget, less noisy than one point), paired difference from fault-free, and the fault-free
    seed-to-seed spread that a difference has to exceed to be distinguishable."""
    kinds: dict[str, Any] = {}
    for name in names:
        final, late = _paired(runs, name, "final_eval_loss"), _paired(runs, name, "late_eval_loss")
        kinds[name] = {
            "final_eval_loss": final["value"],
            "delta_vs_fault_free": final["delta"],
            "delta_pct_vs_fault_free": final["delta_pct"],
            "late_eval_loss": late["value"],
            "late_delta_vs_fault_free": late["delta"],
            "steps": _spread([r[name]["steps"] for r in runs.values()]),
            "tokens": _spread([r[name]["tokens"] for r in runs.values()]),
            "down_replica_steps": _spread([r[name]["down_replica_steps"] for r in runs.values()]),
            # None with one seed: there is no spread to compare with.
            "beyond_fault_free_spread": abs(final["delta"]["median"]) > final["fault_free_spread"]
            if len(runs) > 1
            else None,
        }
    ff = _paired(runs, FAULT_FREE, "final_eval_loss")
    return {
        "seeds": len(runs),
        "fault_free_spread": ff["fault_free_spread"],
        "fault_free_spread_pct": 100 * ff["fault_free_spread"] / ff["value"]["median"],
        "fault_free_late_spread": _paired(runs, FAULT_FREE, "late_eval_loss")["fault_free_spread"],
        "kinds": kinds,
        "pairwise": _pairwise(runs, [n for n in names if n != FAULT_FREE]),
    }


def _pairwise(runs: dict[str, dict[str, Any]], policies: Sequence[str]) -> dict[str, Any]:
    """For each pair of policies: per-seed final loss difference a - b and how often a is lower."""
    out: dict[str, Any] = {}
    for i, a in enumerate(policies):
        for b in policies[i + 1 :]:
            diffs = [r[a]["final_eval_loss"] - r[b]["final_eval_loss"] for r in runs.values()]
            out[f"{a}-{b}"] = {
                "per_seed": diffs,
                "median": statistics.median(diffs),
                "a_lower_on": sum(d < 0 for d in diffs),
            }
    return out


def render(result: dict[str, Any]) -> str:
    """The plain-text table."""
    cfg, summary = result["config"], result["summary"]
    seeds = summary["seeds"]
    lines = [
        f"held-out loss at equal tokens: R={cfg['replicas']} replicas x micro-batch "
        f"{cfg['micro_batch']} x {cfg['block_size']} tokens, budget {cfg['target_tokens']:,} "
        f"tokens ({cfg['steps']} fault-free steps), {seeds} seed(s); {cfg['outages']} outages of "
        f"{cfg['outage_steps']} steps, 1 replica each ({cfg['down_fraction_of_steps']:.0%} of "
        f"fault-free steps); median [min-max] over seeds",
        f"{'run':<11} {'steps':>6} {'down r-steps':>12}  {'final eval loss':<26}"
        f"{'delta vs fault-free':<30}{'delta %':>8}  {'vs ff spread':<13}late-quarter delta",
    ]
    for name, row in summary["kinds"].items():
        lines.append(_row(name, row))
    lines.append(
        f"fault-free seed-to-seed spread (max-min of final eval loss): "
        f"{summary['fault_free_spread']:.4f} ({summary['fault_free_spread_pct']:.2f}%); of the "
        f"late-quarter mean: {summary['fault_free_late_spread']:.4f}"
    )
    for pair, p in summary["pairwise"].items():
        per_seed = ", ".join(f"{d:+.4f}" for d in p["per_seed"])
        a = pair.split("-")[0]
        lines.append(
            f"{pair}: per seed {per_seed}; median {p['median']:+.4f}; "
            f"{a} lower on {p['a_lower_on']}/{seeds}"
        )
    lines.append(f"wall time {result['wall_s']:.1f} s")
    return "\n".join(lines)


def _row(name: str, row: dict[str, Any]) -> str:
    f, d, pct = row["final_eval_loss"], row["delta_vs_fault_free"], row["delta_pct_vs_fault_free"]
    interval = f"{f['median']:.4f} [{f['min']:.4f}-{f['max']:.4f}]"
    if name == FAULT_FREE:
        delta, delta_pct, verdict, late = "-", "-", "", "-"
    else:
        late = f"{row['late_delta_vs_fault_free']['median']:+.4f}"
        delta = f"{d['median']:+.4f} [{d['min']:+.4f}..{d['max']:+.4f}]"
        delta_pct = f"{pct['median']:+.2f}%"
        beyond = row["beyond_fault_free_spread"]
        verdict = "n/a (1 seed)" if beyond is None else ("beyond" if beyond else "within")
    return (
        f"{name:<11} {row['steps']['median']:>6.0f} {row['down_replica_steps']['median']:>12.0f}  "
        f"{interval:<26}{delta:<30}{delta_pct:>8}  {verdict:<13}{late}"
    )


# ---------------------------------------------------------------------------------------------
# Plot


def _median_curve(runs: dict[str, dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """Eval loss per token mark, median over seeds (every run shares the marks)."""
    per_seed = [[e["loss"] for e in r[name]["evals"]] for r in runs.values()]
    marks = [e["mark"] for e in next(iter(runs.values()))[name]["evals"]]
    return marks, [statistics.median(col) for col in zip(*per_seed, strict=True)]


def _median_delta_curve(runs: dict[str, dict[str, Any]], name: str) -> list[float]:
    """Per token mark, the median over seeds of (run kind `name` - fault-free of the same seed)."""
    per_seed = [
        [
            e["loss"] - b["loss"]
            for e, b in zip(r[name]["evals"], r[FAULT_FREE]["evals"], strict=True)
        ]
        for r in runs.values()
    ]
    return [statistics.median(col) for col in zip(*per_seed, strict=True)]


def _outage_spans(run: dict[str, Any], schedule: Sequence[dict[str, int]]) -> list[tuple[int, int]]:
    """Each outage as the (start, end) cumulative tokens of a run with that schedule."""
    cum = [0, *run["per_step"]["tokens"]]
    return [(cum[o["start"]], cum[min(o["start"] + o["length"], len(cum) - 1)]) for o in schedule]


def write_plot(result: dict[str, Any], path: Path) -> Path:
    """Held-out loss vs tokens (median over seeds) and its difference from fault-free, with the
    first seed's outages shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs, names = result["runs"], result["config"]["run_names"]
    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    loss_ax, delta_ax = fig.subplots(2, 1, sharex=True)
    for i, name in enumerate(names):
        marks, losses = _median_curve(runs, name)
        style = {"color": f"C{i}", "label": name, "linewidth": 1.2}  # same color in both panels
        loss_ax.plot(marks, losses, marker=".", **style)
        if name != FAULT_FREE:
            delta_ax.plot(marks, _median_delta_curve(runs, name), **style)
    first = next(iter(runs))
    faulty = [n for n in names if n != FAULT_FREE]
    if faulty:
        spans = _outage_spans(runs[first][faulty[0]], result["schedules"][first])
        for i, (lo, hi) in enumerate(spans):
            for ax in (loss_ax, delta_ax):
                label = f"outage (seed {first})" if i == 0 and ax is loss_ax else None
                ax.axvspan(lo, hi, color="tab:red", alpha=0.12, label=label)
    delta_ax.axhline(0.0, color="black", linewidth=0.8)
    _decorate(loss_ax, delta_ax, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _decorate(loss_ax: Any, delta_ax: Any, result: dict[str, Any]) -> None:
    spread = result["summary"]["fault_free_spread"]
    if spread > 0:
        delta_ax.axhspan(-spread, spread, color="gray", alpha=0.2, label="± fault-free seed spread")
    loss_ax.set_ylabel("held-out loss")
    loss_ax.set_yscale("log")
    loss_ax.set_title(
        f"Held-out loss at equal tokens (median over {result['summary']['seeds']} seeds)"
    )
    delta_ax.set_ylabel("loss - fault-free (paired)")
    delta_ax.set_xlabel("tokens seen")
    for ax in (loss_ax, delta_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
