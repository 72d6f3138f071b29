"""`fthsdp simulate`: the effective training time of a job under failures, FT-HSDP against a
synchronous full restart, in closed form and simulated (`simulate.py` holds the model), printed as
a table swept over failure interval and replica count; optionally JSON and a PNG plot.

Inputs resolve flag > `--paper` or `--from-report` > default; flags default to None so that an
explicit value can be told from a default one."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from fthsdp.deploy.simulate import (
    AT_100K,
    PAPER,
    Estimate,
    JobModel,
    costs_from_report,
    estimate,
    failure_interval_from_mtbf,
)

_DEFAULT_SWEEP_INTERVALS_MIN = (6.0, 18.0, 60.0)
_DEFAULT_SWEEP_REPLICAS = (4, 12, 48)
_DEFAULTS: dict[str, float] = {
    "gpus": 98_304,
    "replicas": 12,
    "step_time_s": 2.0,
    "failure_interval_min": 18.0,
    "detection_s": 0.1,
    "ring_rebuild_s": 0.1,
    "first_step_penalty_s": 0.0,
    "catch_up_s": 7.0,
    "sync_restart_min": 10.0,
    "checkpoint_interval_min": 0.0,
}
"""Without `--paper` or `--from-report`: a 100K-GPU job with fthsdp's measured costs."""


def _number(text: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    if positive and value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _positive(text: str) -> float:
    return _number(text, positive=True)


def _non_negative(text: str) -> float:
    return _number(text, positive=False)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(_positive(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(_count(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers `simulate` on the `fthsdp` command line."""
    p = sub.add_parser(
        "simulate",
        help="model the effective training time under failures, FT-HSDP vs synchronous restart",
        description="Effective training time (the share of GPU-time that trains kept work) of "
        "FT-HSDP and of a synchronous full restart, in closed form and by a discrete-event "
        "simulation of random failures, swept over failure interval and replica count. "
        "Without --paper or --from-report the defaults are a 100K-GPU job with fthsdp's "
        "measured detection and stall.",
    )
    d = _DEFAULTS
    p.add_argument("--gpus", type=_count, help=f"GPUs in the job (default {d['gpus']:.0f})")
    p.add_argument(
        "--replicas", type=_count,
        help=f"replicas, each gpus/replicas GPUs; must divide --gpus (default {d['replicas']:.0f})",
    )  # fmt: skip
    p.add_argument(
        "--step-time-s", type=_positive,
        help=f"fault-free step time; the step in flight is lost on a failure "
        f"(default {d['step_time_s']})",
    )  # fmt: skip
    rate = p.add_mutually_exclusive_group()
    rate.add_argument(
        "--failure-interval-min", type=_positive,
        help=f"mean minutes between failures of the whole job (default "
        f"{d['failure_interval_min']})",
    )  # fmt: skip
    rate.add_argument(
        "--mtbf-hours-per-1000-hosts", type=_positive,
        help="instead: mean hours between failures of 1,000 hosts; the job's interval scales "
        "with its host count (--gpus / --gpus-per-host)",
    )  # fmt: skip
    p.add_argument(
        "--gpus-per-host", type=_count, default=8,
        help="GPUs per host, for --mtbf-hours-per-1000-hosts (default 8)",
    )  # fmt: skip
    p.add_argument(
        "--detection-s", type=_non_negative,
        help=f"FT-HSDP: failure until the survivors know (default {d['detection_s']})",
    )  # fmt: skip
    p.add_argument(
        "--ring-rebuild-s", type=_non_negative,
        help=f"FT-HSDP: survivors' stall to rebuild the rings per failure, shrink and regrow "
        f"together (default {d['ring_rebuild_s']})",
    )  # fmt: skip
    p.add_argument(
        "--first-step-penalty-s", type=_non_negative,
        help=f"FT-HSDP: extra time of the first step on new rings (default "
        f"{d['first_step_penalty_s']})",
    )  # fmt: skip
    p.add_argument(
        "--catch-up-s", type=_non_negative,
        help=f"FT-HSDP: the restarted replica fetching the live state from a peer (default "
        f"{d['catch_up_s']})",
    )  # fmt: skip
    p.add_argument(
        "--replica-restart-min", type=_positive,
        help="FT-HSDP: the failed replica's own restart (default: --sync-restart-min; none with "
        "--from-report, whose time to healthy already holds it)",
    )  # fmt: skip
    p.add_argument(
        "--sync-restart-min", type=_positive,
        help=f"synchronous baseline: the whole job's restart per failure (default "
        f"{d['sync_restart_min']})",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-interval-min", type=_non_negative,
        help="synchronous baseline: minutes of training between durable checkpoints, rolled "
        "back to on a failure; 0 means every step (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--horizon-days", type=_positive, default=365.0,
        help="simulated days per run (default 365)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="first run's seed (default 0)")
    p.add_argument(
        "--runs", type=_count, default=3, help="simulated runs per cell, seeds seed.. (default 3)"
    )
    p.add_argument(
        "--sweep-intervals-min", type=_floats,
        help="failure intervals of the sweep, minutes, comma-separated (default 6,18,60 and "
        "the job's own)",
    )  # fmt: skip
    p.add_argument(
        "--sweep-replicas", type=_ints,
        help="replica counts of the sweep, comma-separated, each dividing --gpus (default those "
        "of 4,12,48 that do, and --replicas)",
    )  # fmt: skip
    preset = p.add_mutually_exclusive_group()
    preset.add_argument(
        "--paper", action="store_true",
        help="the FT-HSDP paper's inputs: 98,304 GPUs in 12 replicas, a failure every 18 min, "
        "10 min restarts, a 3 min stall (its ETT: 44%% synchronous, 80%% FT-HSDP)",
    )  # fmt: skip
    preset.add_argument(
        "--from-report", type=Path, metavar="PATH",
        help="take detection, rebuild stall and catch-up from a demo report.json (medians over "
        "its replica failures)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="also write a PNG plot")


@dataclass(kw_only=True, slots=True, frozen=True)
class _Resolved:
    """The job and the run's settings once flags, preset and defaults are merged."""

    model: JobModel
    """The job as given."""
    measured: JobModel
    """The 100K-GPU job with fthsdp's costs (flags > report > measured defaults)."""
    sweep_intervals_min: tuple[float, ...]
    """Failure intervals of the sweep."""
    sweep_replicas: tuple[int, ...]
    """Replica counts of the sweep."""
    source: str
    """Where the defaults came from, for the header."""


def _report_costs(path: Path) -> dict[str, float]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--from-report: cannot read {path}: {exc}") from None
    if not isinstance(report, dict):
        raise ValueError(f"--from-report: {path} is not a JSON object")
    try:
        costs = costs_from_report(report)
    except ValueError as exc:
        raise ValueError(f"--from-report: {path}: {exc}") from None
    return {
        "detection_s": costs.detection.total_seconds(),
        "ring_rebuild_s": costs.ring_rebuild.total_seconds(),
        "catch_up_s": costs.catch_up.total_seconds(),
        # The measured stall is a commit gap, so it already holds the slower first step.
        "first_step_penalty_s": 0.0,
    }


def _paper_values() -> dict[str, float]:
    m = PAPER
    return {
        "gpus": m.gpus,
        "replicas": m.replicas,
        "step_time_s": m.step_time.total_seconds(),
        "failure_interval_min": m.failure_interval / timedelta(minutes=1),
        "detection_s": m.detection.total_seconds(),
        "ring_rebuild_s": m.ring_rebuild.total_seconds(),
        "first_step_penalty_s": m.first_step_penalty.total_seconds(),
        "catch_up_s": m.catch_up.total_seconds(),
        "sync_restart_min": m.sync_restart / timedelta(minutes=1),
        "checkpoint_interval_min": 0.0,
    }


def _check_replicas(flag: str, replicas: int, gpus: int) -> None:
    if replicas > gpus:
        raise ValueError(f"{flag}: {replicas} replicas exceed --gpus {gpus}")
    if gpus % replicas:
        raise ValueError(f"{flag}: --gpus {gpus} is not divisible by {replicas} replicas")


def _model(v: dict[str, float], args: argparse.Namespace, gpus: int, replicas: int) -> JobModel:
    sync_restart = timedelta(minutes=v["sync_restart_min"])
    if args.replica_restart_min is not None:
        replica_restart = timedelta(minutes=args.replica_restart_min)
    elif args.from_report and not args.paper:
        # The report's time to healthy, the catch-up here, already holds the process restart.
        replica_restart = timedelta(0)
    else:
        replica_restart = sync_restart
    if args.mtbf_hours_per_1000_hosts is not None:
        interval = failure_interval_from_mtbf(
            args.mtbf_hours_per_1000_hosts, gpus=gpus, gpus_per_host=args.gpus_per_host
        )
    else:
        interval = timedelta(minutes=v["failure_interval_min"])
    return JobModel(
        gpus=gpus,
        replicas=replicas,
        failure_interval=interval,
        step_time=timedelta(seconds=v["step_time_s"]),
        detection=timedelta(seconds=v["detection_s"]),
        ring_rebuild=timedelta(seconds=v["ring_rebuild_s"]),
        first_step_penalty=timedelta(seconds=v["first_step_penalty_s"]),
        catch_up=timedelta(seconds=v["catch_up_s"]),
        replica_restart=replica_restart,
        sync_restart=sync_restart,
        checkpoint_interval=timedelta(minutes=v["checkpoint_interval_min"]),
    )


def _resolve(args: argparse.Namespace) -> _Resolved:
    report = _report_costs(args.from_report) if args.from_report else {}
    preset = _paper_values() if args.paper else report
    source = "the paper" if args.paper else f"{args.from_report}" if args.from_report else ""
    explicit = {k: getattr(args, k) for k in _DEFAULTS if getattr(args, k) is not None}
    values = {**_DEFAULTS, **preset, **explicit}
    gpus, replicas = int(values["gpus"]), int(values["replicas"])
    _check_replicas("--replicas", replicas, gpus)
    model = _model(values, args, gpus, replicas)
    # The 100K line keeps fthsdp's own detection, stall and catch-up even under --paper.
    costs = ("detection_s", "ring_rebuild_s", "first_step_penalty_s", "catch_up_s")
    fthsdp = {k: {**_DEFAULTS, **report, **explicit}[k] for k in costs}
    measured = replace(
        model,
        gpus=AT_100K.gpus,
        replicas=AT_100K.replicas,
        failure_interval=AT_100K.failure_interval,
        detection=timedelta(seconds=fthsdp["detection_s"]),
        ring_rebuild=timedelta(seconds=fthsdp["ring_rebuild_s"]),
        first_step_penalty=timedelta(seconds=fthsdp["first_step_penalty_s"]),
        catch_up=timedelta(seconds=fthsdp["catch_up_s"]),
    )
    if args.sweep_replicas is not None:
        for r in args.sweep_replicas:
            _check_replicas("--sweep-replicas", r, gpus)
        sweep_replicas = tuple(dict.fromkeys(args.sweep_replicas))
    else:
        fits = [r for r in _DEFAULT_SWEEP_REPLICAS if r <= gpus and gpus % r == 0]
        sweep_replicas = tuple(sorted({*fits, replicas}))
    own = model.failure_interval / timedelta(minutes=1)
    intervals = args.sweep_intervals_min or tuple(sorted({*_DEFAULT_SWEEP_INTERVALS_MIN, own}))
    return _Resolved(
        model=model,
        measured=measured,
        sweep_intervals_min=tuple(dict.fromkeys(intervals)),
        sweep_replicas=sweep_replicas,
        source=source,
    )


def _pct(x: float) -> str:
    return f"{100 * x:5.1f} %"


def _pp(a: float, b: float) -> str:
    return f"{100 * (b - a):+5.2f} pp"


def _describe(m: JobModel) -> list[str]:
    minutes = m.failure_interval / timedelta(minutes=1)
    return [
        f"{m.gpus} GPUs = {m.replicas} replicas x {m.gpus // m.replicas}, a failure every "
        f"{minutes:.4g} min (job-wide), step {m.step_time.total_seconds():g} s",
        f"  FT-HSDP: stall S = {m.stall_s:.4g} s per failure (detection "
        f"{m.detection.total_seconds():g} + rebuild {m.ring_rebuild.total_seconds():g} + "
        f"first step {m.first_step_penalty.total_seconds():g} + half a step); failed replica "
        f"out D = {m.recovery_s:.5g} s (detection + restart "
        f"{m.replica_restart.total_seconds():g} + catch-up {m.catch_up.total_seconds():g})",
        f"  synchronous: restart R = {m.sync_restart.total_seconds():g} s per failure, rollback "
        f"L = {m.rollback_s:.4g} s (checkpoint every {m.checkpoint_s:g} s)",
    ]


def _summary(e: Estimate) -> list[str]:
    return [
        f"{'ETT':<13}{'closed form':>12}{'simulated':>12}{'± sd':>8}{'sim − closed':>14}",
        f"{'FT-HSDP':<13}{_pct(e.ft_closed):>12}{_pct(e.ft_sim):>12}"
        f"{100 * e.ft_sim_sd:>8.2f}{_pp(e.ft_closed, e.ft_sim):>14}",
        f"{'synchronous':<13}{_pct(e.sync_closed):>12}{_pct(e.sync_sim):>12}"
        f"{100 * e.sync_sim_sd:>8.2f}{_pp(e.sync_closed, e.sync_sim):>14}",
    ]


def _sweep_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    head = (
        f"{'replicas':>8} {'every':>9}  {'FT closed':>9} {'FT sim':>8} {'diff':>9}  "
        f"{'sync closed':>11} {'sync sim':>8} {'diff':>9}"
    )
    lines = [head]
    for r in rows:
        e = r["estimate"]
        lines.append(
            f"{r['replicas']:>8} {r['failure_interval_min']:>5.4g} min  {_pct(e.ft_closed):>9} "
            f"{_pct(e.ft_sim):>8} {_pp(e.ft_closed, e.ft_sim):>9}  {_pct(e.sync_closed):>11} "
            f"{_pct(e.sync_sim):>8} {_pp(e.sync_closed, e.sync_sim):>9}"
        )
    return lines


def _at_100k_line(m: JobModel, e: Estimate) -> str:
    return (
        f"at 100K GPUs with fthsdp's measured detection and stall ({m.replicas} x "
        f"{m.gpus // m.replicas} GPUs, a failure every "
        f"{m.failure_interval / timedelta(minutes=1):.4g} min, detection "
        f"{m.detection.total_seconds():g} s, rebuild {m.ring_rebuild.total_seconds():g} s, "
        f"catch-up {m.catch_up.total_seconds():g} s, replica restart "
        f"{m.replica_restart / timedelta(minutes=1):g} min): FT-HSDP "
        f"{_pct(e.ft_closed).strip()} (simulated {_pct(e.ft_sim).strip()}), synchronous restart "
        f"{_pct(e.sync_closed).strip()} (simulated {_pct(e.sync_sim).strip()})"
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Prints the model, the sweep and the 100K line; writes --json and --plot. ValueError
    (naming the flag) for inputs that do not fit together."""
    r = _resolve(args)
    sim = {
        "horizon": timedelta(days=args.horizon_days),
        "runs": args.runs,
        "seed": args.seed,
    }
    main = estimate(r.model, **sim)
    rows: list[dict[str, Any]] = []
    for replicas in r.sweep_replicas:
        for minutes in r.sweep_intervals_min:
            cell = replace(r.model, replicas=replicas, failure_interval=timedelta(minutes=minutes))
            rows.append(
                {
                    "replicas": replicas,
                    "failure_interval_min": minutes,
                    "estimate": estimate(cell, **sim),
                }
            )
    at_100k = estimate(r.measured, **sim)
    lines = [f"fthsdp simulate{f' (inputs from {r.source})' if r.source else ''}:"]
    lines += _describe(r.model)
    lines.append(
        f"  simulation: {args.horizon_days:g} days x {args.runs} runs from seed {args.seed}, "
        f"{main.failures} failures"
    )
    lines += ["", *_summary(main), "", "sweep (ETT):", *_sweep_table(rows), ""]
    if any(abs(row["estimate"].ft_sim - row["estimate"].ft_closed) > 0.01 for row in rows):
        lines.append(
            "note: the FT-HSDP closed form is first order in stall/MTBF; where stalls take a "
            "large share of the time the simulated figure is the better one"
        )
    lines.append(_at_100k_line(r.measured, at_100k))
    print("\n".join(lines), file=out)
    if args.json:
        args.json.write_text(json.dumps(_json(r, main, rows, at_100k, args), indent=2) + "\n")
        print(f"json: {args.json}", file=out)
    if args.plot:
        _write_plot(args.plot, rows)
        print(f"plot: {args.plot}", file=out)
    return 0


def _inputs(m: JobModel) -> dict[str, Any]:
    return {
        "gpus": m.gpus,
        "replicas": m.replicas,
        "failure_interval_min": round(m.failure_interval / timedelta(minutes=1), 6),
        "step_time_s": m.step_time.total_seconds(),
        "detection_s": m.detection.total_seconds(),
        "ring_rebuild_s": m.ring_rebuild.total_seconds(),
        "first_step_penalty_s": m.first_step_penalty.total_seconds(),
        "catch_up_s": m.catch_up.total_seconds(),
        "replica_restart_min": m.replica_restart / timedelta(minutes=1),
        "sync_restart_min": m.sync_restart / timedelta(minutes=1),
        "checkpoint_interval_min": m.checkpoint_interval / timedelta(minutes=1),
        "stall_s": round(m.stall_s, 6),
        "recovery_s": round(m.recovery_s, 6),
        "rollback_s": round(m.rollback_s, 6),
    }


def _json(
    r: _Resolved,
    main: Estimate,
    rows: Sequence[dict[str, Any]],
    at_100k: Estimate,
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "inputs": _inputs(r.model),
        "source": r.source or None,
        "simulation": {"horizon_days": args.horizon_days, "runs": args.runs, "seed": args.seed},
        "ett": main.as_dict(),
        "sweep": [
            {
                "replicas": row["replicas"],
                "failure_interval_min": row["failure_interval_min"],
                **row["estimate"].as_dict(),
            }
            for row in rows
        ],
        "at_100k": {"inputs": _inputs(r.measured), "ett": at_100k.as_dict()},
    }


def _write_plot(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """ETT against failure interval, a line per (method, replica count): closed form drawn,
    simulation as markers. The Agg canvas on a bare Figure, as `demo/plot.py` does: no pyplot
    state, no display."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--plot: matplotlib is not installed") from None
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for replicas in dict.fromkeys(row["replicas"] for row in rows):
        cells = sorted(
            (row for row in rows if row["replicas"] == replicas),
            key=lambda row: row["failure_interval_min"],
        )
        x = [row["failure_interval_min"] for row in cells]
        for method, style in (("ft", "-"), ("sync", "--")):
            closed = [100 * getattr(row["estimate"], f"{method}_closed") for row in cells]
            simulated = [100 * getattr(row["estimate"], f"{method}_sim") for row in cells]
            name = "FT-HSDP" if method == "ft" else "synchronous"
            (line,) = ax.plot(x, closed, style, label=f"{name}, {replicas} replicas")
            ax.plot(x, simulated, "o", color=line.get_color(), markersize=4)
    ax.set_xscale("log")
    ax.set_xlabel("mean time between failures of the job (min)")
    ax.set_ylabel("effective training time (%)")
    ax.set_ylim(0, 100)
    ax.set_title("ETT: closed form (lines), simulated (dots)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path, format="png", dpi=120)
