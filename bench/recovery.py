"""What failures cost under FT-HSDP vs a synchronous whole-job restart, and what fault tolerance
costs when nothing fails.

    python -m bench.recovery --replicas 3 --ranks 2 --duration-s 60 --kill-every-s 15 \
        --kill-mode process --seed 0 --spares 2 --json bench-recovery.json

Runs the demo job (`deploy.demo.run.run_demo`, real processes and real kills) several times in one
invocation, so every comparison is between runs measured side by side on the same machine:

1. `fthsdp`: failures on a schedule, restart policy "replica" (only the failed replica restarts and
   catches up from its peers): detection (kill → a quorum without the victim), the survivors'
   stall and the time until the victim commits again; median and max over the failures.
2. `baseline`: the same schedule (seed, duration, period, mode) under restart policy "job" (every
   replica restarts from the last durable checkpoint on any failure).
2b. `spares` (with `--spares N`): the `fthsdp` schedule again, with N warm spare rank processes
   (torch imported, model built) that a restarted replica takes over: time to healthy side by
   side with fresh processes.
3. `faultfree`: the same duration without failures and, like the DDP baseline, without durable
   checkpoints (`--faultfree-durable-every-steps`); its committed replica-steps per second over
   the span from the first to the last commit is the fault-free rate (so the ETT below is, if
   anything, understated: the runs with failures also write durable checkpoints).
4. Effective training time in time, not steps: ETT = useful replica-steps / (fault-free rate ×
   the run's training span). Useful replica-steps are the report's distinct (step, contributing
   replica) pairs, so work a rollback threw away is not counted twice. The training span runs from
   the first to the last commit, which leaves out process start and shutdown (the same for every
   policy) but keeps every restart, catch-up and the end phase's wait for all replicas. The variant
   over the report's wall time (launch → end, start-up included) is in the JSON too, as is the
   report's own replica-step ratio.
5. Fault-free overhead: the median commit interval of the fault-free run (per replica, warm-up
   skipped) against plain torch DDP over gloo with replicas × ranks processes in one group, same
   model, seed, micro-batch and sampling (`bench.ddp_baseline`), run right before and right after
   the fault-free run so load drift hits both sides alike. Same number of training processes on
   both sides (replicas × ranks, one intra-op thread each); DDP's all-reduce of its single
   bucket (the model is far below DDP's 25 MB bucket) runs inside backward, fthsdp's exchange
   after backward (the demo's default; `overlap_backward` is off). What only fthsdp pays is
   counted against it: the quorum service (embedded in this process), one checkpoint sidecar
   process per replica, the data-position records (once a second), the leaders' quorum
   requests, the Manager's threads and, unless `--no-health`, the health service's processes
   and every rank's telemetry. On its own, with several repeats, each fault-free run between two DDP
   runs (the median ratio is the number to read; the spread of the DDP medians is the noise):

    python -m bench.recovery --overhead-only --overhead-repeats 3 --duration-s 20 \
        --json bench-overhead.json

   With `--health-arms`, a fault-free run without the health service follows each one with it,
   and health's own cost is the median of their ratios (adjacent runs, so the load drift between
   them is a minute's, not the whole benchmark's).

Prints a table next to the targets of DESIGN.md and writes JSON with every number, the command
line, the machine (CPUs, load average) and the settings. Not a pass/fail test: on a small shared
machine the absolute numbers move with the load; the ratios are what to read."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from fthsdp.bench.ddp_baseline import run_ddp
from fthsdp.bench.recovery_render import FAILURE_METRICS, dig, render
from fthsdp.deploy.demo.events import CommitEvent, RestartEvent, RunLog
from fthsdp.deploy.demo.run import DemoConfig, run_demo
from fthsdp.services.common import logs

log = logging.getLogger("fthsdp.bench.recovery")

TARGET_DETECTION_S = 1.0
"""DESIGN.md: failure → new quorum within 1 s."""
TARGET_STALL_EXTRA_S = 1.0
"""DESIGN.md: survivors stall at most one step + 1 s per failure."""
TARGET_OVERHEAD = 1.02
"""DESIGN.md: control-plane overhead on a fault-free step ≤ 2% over plain DDP/gloo."""
PHASE_KEYS = ("quorum", "ring", "exchange", "fetch", "vote", "commit")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3, help="replicas (units of failure)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica")
    p.add_argument("--duration-s", type=float, default=60.0, help="training seconds per run")
    p.add_argument("--kill-every-s", type=float, default=15.0, help="seconds between failures")
    p.add_argument(
        "--kill-mode", default="process", choices=("process", "replica", "hang"), help="fault kind"
    )
    p.add_argument("--seed", type=int, default=0, help="failure schedule and model seed")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per rank per step")
    p.add_argument(
        "--warmup-steps", type=int, default=20, help="commits per replica left out of step times"
    )
    p.add_argument("--ddp-steps", type=int, default=300, help="measured DDP steps per DDP run")
    p.add_argument("--ddp-warmup", type=int, default=30, help="unmeasured DDP steps first")
    p.add_argument(
        "--overhead-only",
        action="store_true",
        help="only the fault-free overhead: DDP and fault-free fthsdp runs, alternating",
    )
    p.add_argument(
        "--overhead-repeats",
        type=int,
        default=1,
        help="fault-free fthsdp runs, each between two DDP runs (the ratio's median is reported)",
    )
    p.add_argument(
        "--no-health",
        action="store_true",
        help="run fthsdp without the health service and its telemetry (on a 2-core machine its "
        "processes compete with training for the same cores; in production they run elsewhere)",
    )
    p.add_argument(
        "--health-arms",
        action="store_true",
        help="with --overhead-only: also a fault-free run without the health service right after "
        "each one with it, so health's own cost is the ratio of two adjacent runs (not valid "
        "with --no-health)",
    )
    p.add_argument(
        "--faultfree-durable-every-steps",
        type=int,
        default=0,
        help="durable checkpoint period of the fault-free runs (default 0: the DDP baseline "
        "writes none either; the runs with failures keep the demo's period)",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="also run the failure schedule with this many warm spares (FT-HSDP policy) and "
        "show it next to the fresh restarts (default 0: no such run)",
    )
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument(
        "--work-dir", type=Path, help="run directories go under it (default: a new temp dir)"
    )
    args = p.parse_args(argv)
    if args.replicas < 2:
        p.error("--replicas must be >= 2 (one must survive a failure)")
    if args.overhead_repeats < 1:
        p.error("--overhead-repeats must be >= 1")
    if args.health_arms and (args.no_health or not args.overhead_only):
        p.error("--health-arms needs --overhead-only and the health service (no --no-health)")
    if args.faultfree_durable_every_steps < 0:
        p.error("--faultfree-durable-every-steps must be >= 0")
    if args.ranks < 1 or args.micro_batch < 1 or args.ddp_steps < 1:
        p.error("--ranks, --micro-batch and --ddp-steps must be >= 1")
    if args.duration_s <= 0 or args.kill_every_s <= 0:
        p.error("--duration-s and --kill-every-s must be positive")
    return args


# ---------------------------------------------------------------------------------------------
# Machine and helpers


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    import torch

    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_avg_start": _load(),
    }


def _stats(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "median": None, "max": None, "p90": None}
    ordered = sorted(values)
    return {
        "n": len(values),
        "median": statistics.median(ordered),
        "max": ordered[-1],
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# ---------------------------------------------------------------------------------------------
# One demo run and its analysis


def _step_times(log_: RunLog, warmup: int) -> dict[str, Any]:
    """Commit intervals of consecutive steps of one replica (a restart or rollback breaks the
    chain), each with the phase seconds its commit line reported; the first `warmup` commits of
    every replica are left out."""
    intervals: list[float] = []
    phases: dict[str, list[float]] = {k: [] for k in (*PHASE_KEYS, "rest")}
    for replica in log_.replicas:
        commits = log_.commits(replica)[warmup:]
        for a, b in itertools.pairwise(commits):
            if b.step != a.step + 1 or b.t <= a.t:
                continue
            gap = b.t - a.t
            intervals.append(gap)
            inside = 0.0
            for key in PHASE_KEYS:
                value = b.seconds.get(key, 0.0)
                phases[key].append(value)
                inside += value
            # Data, forward, backward, the intra-replica sum, the optimizer step and logging.
            phases["rest"].append(max(0.0, gap - inside))
    return {
        "interval_s": _stats(intervals),
        "phase_median_s": {k: statistics.median(v) if v else None for k, v in phases.items()},
    }


def _failures(report: dict[str, Any], first_commit_rel: float | None) -> dict[str, Any]:
    """Median and max per metric over the failures injected after the first commit; the demo's
    schedule counts from launch, so a kill can land while ranks still import torch, before the
    replica ever joined: nothing to detect and no survivors yet. Those are counted, not mixed in
    (the `all_*` entries include them)."""
    failures = report.get("failures", [])
    start = first_commit_rel if first_commit_rel is not None else float("inf")
    training = [f for f in failures if f["t"] >= start]
    out: dict[str, Any] = {
        "injected": len(failures),
        "before_first_commit": len(failures) - len(training),
    }
    for key in FAILURE_METRICS:
        for prefix, subset in (("", training), ("all_", failures)):
            values = [float(f[key]) for f in subset if f.get(key) is not None]
            out[prefix + key] = {**_stats(values), "missing": len(subset) - len(values)}
    return out


def _survivor_pace(
    log_: RunLog, report: dict[str, Any], t_run: float, first_commit_rel: float
) -> list[float]:
    """Per failure (after the first commit), the survivors' steps per second from the kill until
    the victim committed again. On a small machine the victim's restart (interpreter start, torch
    import) competes with the survivors for CPU, which a real cluster would not see."""
    rates: list[float] = []
    for f in report.get("failures", []):
        if f["t"] < first_commit_rel or f.get("time_to_healthy_s") is None or not f["replica"]:
            continue
        a = t_run + f["t"]
        b = a + f["time_to_healthy_s"]
        steps = {c.step for c in log_.commits() if c.replica != f["replica"] and a <= c.t <= b}
        if b > a:
            rates.append(len(steps) / (b - a))
    return rates


def _full_prefix(commits: list[CommitEvent], report: dict[str, Any]) -> int:
    """Steps 0..k-1 in which every replica contributed (final history): only there does a step
    train the same samples as a DDP step with the same index."""
    total = dig(report, "run", "total_replicas") or 0
    latest: dict[int, CommitEvent] = {}
    for c in commits:
        latest[c.step] = c
    k = 0
    while k in latest and len(latest[k].trained) == total:
        k += 1
    return k


def analyse_run(run_dir: Path, report: dict[str, Any], warmup: int) -> dict[str, Any]:
    """The numbers this benchmark reads from one finished demo run."""
    log_ = RunLog.load(run_dir)
    commits: list[CommitEvent] = log_.commits()
    summary = report["summary"]
    t_run = log_.run.t if log_.run is not None else None
    first = commits[0].t if commits else None
    last = commits[-1].t if commits else None
    span = (last - first) if first is not None and last is not None else None
    # One rule for what training survived: the report's ledger (by rollback generation).
    useful = int(summary["useful_replica_steps"])
    losses = report.get("series", {}).get("loss", {})
    return {
        "run_dir": str(run_dir),
        "invariants": {k: v.get("ok") for k, v in report.get("invariants", {}).items()},
        "invariant_details": {k: v.get("detail") for k, v in report.get("invariants", {}).items()},
        "inconsistencies": len(report.get("inconsistencies", [])),
        "skipped_lines": len(report.get("skipped_lines", [])),
        "summary": summary,
        "report_ett": report.get("effective_training_time"),
        "startup_s": None if first is None or t_run is None else first - t_run,
        "span_s": span,
        "launch_span_s": None if last is None or t_run is None else last - t_run,
        "full_prefix_steps": _full_prefix(commits, report),
        "useful_replica_steps": useful,
        "discarded_replica_steps": int(summary.get("rolled_back_replica_steps", 0)),
        "replica_steps_per_s": useful / span if span else None,
        "replica_steps_per_launch_s": useful / (last - t_run)
        if last is not None and t_run is not None and last > t_run
        else None,
        "replica_steps_per_wall_s": useful / summary["wall_time_s"]
        if summary.get("wall_time_s")
        else None,
        "restarts": len(log_.of_type(RestartEvent)),
        "step_times": _step_times(log_, warmup),
        "failure_list": report.get("failures", []),
        "failures": _failures(report, None if first is None or t_run is None else first - t_run),
        "survivor_steps_per_s_during_recovery": []
        if first is None or t_run is None
        else _survivor_pace(log_, report, t_run, first - t_run),
        "steps_per_s": summary["steps_committed"] / span if span else None,
        "loss_r0": losses.get("r0", []),
    }


def run_phase(
    name: str,
    args: argparse.Namespace,
    root: Path,
    *,
    policy: str,
    kills: bool,
    spares: int = 0,
    health: bool | None = None,
) -> dict[str, Any]:
    """One demo run; `health` overrides `--no-health` (the health arms)."""
    run_dir = root / name
    config = DemoConfig(
        replicas=args.replicas,
        ranks=args.ranks,
        duration=timedelta(seconds=args.duration_s),
        kill_every=timedelta(seconds=args.kill_every_s) if kills else None,
        kill_mode=args.kill_mode,
        seed=args.seed,
        run_dir=run_dir,
        micro_batch=args.micro_batch,
        restart_policy=policy,
        live=False,
        health=not args.no_health if health is None else health,
        spares=spares,
    )
    if not kills:
        config = dataclasses.replace(config, durable_every_steps=args.faultfree_durable_every_steps)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: demo, policy={policy}, kills={kills} → {run_dir}")
    return _timed(name, lambda: analyse_run(run_dir, run_demo(config), args.warmup_steps))


def run_ddp_phase(name: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    print(f"[{time.strftime('%H:%M:%S')}] {name}: DDP/gloo, {args.replicas * args.ranks} ranks")

    def body() -> dict[str, Any]:
        results = run_ddp(
            replicas=args.replicas,
            ranks=args.ranks,
            steps=args.ddp_steps,
            warmup=args.ddp_warmup,
            micro_batch=args.micro_batch,
            seed=args.seed,
            work_dir=root / name,
        )
        intervals = [v for r in results for v in r["intervals"]]
        phases = {
            k: statistics.median(v for r in results for v in r["phases"][k])
            for k in results[0]["phases"]
        }
        return {
            "run_dir": str(root / name),
            "interval_s": _stats(intervals),
            "phase_median_s": phases,
            "losses_rank0": results[0]["losses"],
        }

    return _timed(name, body)


def _timed(name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    load_start, t0 = _load(), time.monotonic()
    try:
        out = body()
    except Exception as exc:  # one broken phase must not hide the others' numbers
        log.exception("%s failed", name)
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out.update(bench_wall_s=time.monotonic() - t0, load_avg_start=load_start, load_avg_end=_load())
    return out


# ---------------------------------------------------------------------------------------------
# Comparison


def _loss_agreement(
    fthsdp: list[list[float]], ddp: list[float], full_prefix: int
) -> dict[str, Any] | None:
    """fthsdp's r0/rank-0 loss per step against DDP rank 0's, over the first steps in which all
    replicas contributed: the same model and data give the same numbers (bitwise at first;
    summation order drifts them later). Once a replica misses a step the data no longer lines
    up by step index."""
    limit = min(full_prefix, len(ddp))
    pairs = [(float(loss), ddp[int(step)]) for step, loss in fthsdp if int(step) < limit]
    if not pairs:
        return {"steps_compared": 0, "full_prefix_steps": full_prefix}
    bitwise = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    return {
        "steps_compared": len(pairs),
        "full_prefix_steps": full_prefix,
        "bitwise_equal_first_steps": bitwise,
        "max_abs_diff": max(abs(a - b) for a, b in pairs),
    }


def compare(phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ff, ft, base = phases.get("faultfree", {}), phases.get("fthsdp", {}), phases.get("baseline", {})
    rate = ff.get("replica_steps_per_s")
    rate_launch = ff.get("replica_steps_per_launch_s")
    rate_wall = ff.get("replica_steps_per_wall_s")

    def ett(run: dict[str, Any]) -> dict[str, Any]:
        useful, span = run.get("useful_replica_steps"), run.get("span_s")
        wall = dig(run, "summary", "wall_time_s")
        launch = run.get("launch_span_s")
        return {
            "time_launch": None
            if not rate_launch or not launch
            else useful / (rate_launch * launch),
            "time_span": None if not rate or not span else useful / (rate * span),
            "time_wall": None if not rate_wall or not wall else useful / (rate_wall * wall),
            "report_replica_steps": run.get("report_ett"),
        }

    ett_ft, ett_base = ett(ft), ett(base)
    ddp_runs = [phases[k] for k in ("ddp_before", "ddp_after") if "interval_s" in phases.get(k, {})]
    ddp_medians = [r["interval_s"]["median"] for r in ddp_runs]
    ddp_median = statistics.mean(ddp_medians) if ddp_medians else None
    ft_step = dig(ff, "step_times", "interval_s", "median")
    report_step = dig(ff, "summary", "median_step_s")
    ddp_losses = ddp_runs[0]["losses_rank0"] if ddp_runs else []
    ff_steps = ff.get("steps_per_s")
    pace = {
        name: _ratio(statistics.median(r), ff_steps) if r else None
        for name, r in (
            ("fthsdp", ft.get("survivor_steps_per_s_during_recovery")),
            ("baseline", base.get("survivor_steps_per_s_during_recovery")),
        )
    }
    return {
        "fault_free_replica_steps_per_s": rate,
        "fault_free_steps_per_s": ff_steps,
        "survivor_pace_vs_fault_free": pace,
        "ett": {"fthsdp": ett_ft, "baseline": ett_base}
        | ({"spares": ett(phases["spares"])} if "spares" in phases else {}),
        "ett_ratio": {k: _ratio(ett_ft[k], ett_base[k]) for k in ett_ft},
        "overhead": {
            "fthsdp_median_step_s": ft_step,
            "fthsdp_report_median_step_s": report_step,
            "ddp_median_step_s": ddp_median,
            "ddp_median_step_s_each": ddp_medians,
            "ratio": _ratio(ft_step, ddp_median),
            "ratio_report_median": _ratio(report_step, ddp_median),
            "target": TARGET_OVERHEAD,
        },
        "stall_target_s": None if ft_step is None else ft_step + TARGET_STALL_EXTRA_S,
        "loss_agreement": _loss_agreement(
            ff.get("loss_r0", []), ddp_losses, ff.get("full_prefix_steps", 0)
        )
        if ddp_losses
        else None,
    }


def _repeat(phase: str, i: int) -> str:
    """The name of a phase's i-th repeat (the first keeps the bare name)."""
    return phase if i == 0 else f"{phase}_{i}"


def overhead_repeats(phases: dict[str, dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Per fault-free run, its median step against the mean of the DDP runs right before and
    right after it; the median over the runs is the overhead to read. The spread of the DDP
    runs' medians is the machine's noise on this measurement."""
    ddp_names = ["ddp_before", *(_repeat("ddp_after", i) for i in range(repeats))]
    ddp = [dig(phases, name, "interval_s", "median") for name in ddp_names]
    rows = []
    for i in range(repeats):
        ft = dig(phases, _repeat("faultfree", i), "step_times", "interval_s")
        around = [v for v in (ddp[i], ddp[i + 1]) if v is not None]
        base = statistics.mean(around) if around else None
        median = None if ft is None else ft.get("median")
        rows.append({"fthsdp_median_step_s": median, "ddp_median_step_s": base,
                     "ratio": _ratio(median, base)})  # fmt: skip
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    known = [v for v in ddp if v is not None]
    return {
        "health_cost": _health_cost(phases, repeats),
        "runs": rows,
        "ddp_median_step_s_each": ddp,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios, default=None),
        "ratio_max": max(ratios, default=None),
        "ddp_noise": (max(known) - min(known)) / statistics.median(known) if known else None,
    }


def _health_cost(phases: dict[str, dict[str, Any]], repeats: int) -> dict[str, Any] | None:
    """With the health arms: per repeat, the fault-free median step with health over the one
    without it right after (the same machine a minute apart); None without them."""
    ratios = []
    for i in range(repeats):
        if _repeat("faultfree_nohealth", i) not in phases:
            return None
        on = dig(phases, _repeat("faultfree", i), "step_times", "interval_s", "median")
        off = dig(phases, _repeat("faultfree_nohealth", i), "step_times", "interval_s", "median")
        ratios.append(_ratio(on, off))
    known = [r for r in ratios if r is not None]
    return {"ratios": ratios, "median": statistics.median(known) if known else None}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure("WARNING")
    base_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="fthsdp-bench-recovery-"))
    # A run directory is appended to and resumed from, so every invocation gets a fresh one.
    root = base_dir / datetime.now().strftime("recovery-%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=False)
    mach = machine()
    started = time.monotonic()
    phases: dict[str, dict[str, Any]] = {}
    if not args.overhead_only:
        phases["fthsdp"] = run_phase("fthsdp", args, root, policy="replica", kills=True)
        phases["baseline"] = run_phase("baseline", args, root, policy="job", kills=True)
        if args.spares:
            phases["spares"] = run_phase(
                "spares", args, root, policy="replica", kills=True, spares=args.spares
            )
    # DDP, fthsdp, DDP, fthsdp, ..., DDP: each fault-free run sits between two DDP runs, so load
    # drift during the benchmark hits both sides alike.
    phases["ddp_before"] = run_ddp_phase("ddp_before", args, root)
    for i in range(args.overhead_repeats):
        name = _repeat("faultfree", i)
        phases[name] = run_phase(name, args, root, policy="replica", kills=False)
        if args.health_arms:
            name = _repeat("faultfree_nohealth", i)
            phases[name] = run_phase(name, args, root, policy="replica", kills=False, health=False)
        name = _repeat("ddp_after", i)
        phases[name] = run_ddp_phase(name, args, root)
    mach["load_avg_end"] = _load()
    result: dict[str, Any] = {
        "benchmark": "recovery",
        "command": shlex.join([sys.executable, "-m", "fthsdp.bench.recovery", *sys.argv[1:]])
        if argv is None
        else shlex.join(["python", "-m", "fthsdp.bench.recovery", *argv]),
        "settings": {
            k: str(v) if isinstance(v, Path) else v for k, v in sorted(vars(args).items())
        },
        "machine": mach,
        "work_dir": str(root),
        "total_s": time.monotonic() - started,
        "targets": {
            "detection_s": TARGET_DETECTION_S,
            "survivor_stall_s": "one fault-free step + 1 s",
            "overhead_ratio": TARGET_OVERHEAD,
        },
        "phases": phases,
    }
    comparison = compare(phases)
    comparison["overhead_repeats"] = overhead_repeats(phases, args.overhead_repeats)
    result["comparison"] = comparison
    # JSON first: the numbers survive even if rendering trips over a missing one.
    text = json.dumps(result, indent=2)
    (root / "recovery.json").write_text(text)
    if args.json is not None:
        args.json.write_text(text)
    print()
    print(render(result))
    print(f"\ntotal {result['total_s']:.0f} s; JSON: {args.json or root / 'recovery.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
