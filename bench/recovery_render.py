"""The tables `bench.recovery` prints from its result document (`recovery.py` measures)."""

from __future__ import annotations

from typing import Any

FAILURE_METRICS = ("detection_s", "survivor_stall_s", "time_to_healthy_s")
"""What each failure is measured by (the report's per-failure figures)."""


def dig(d: dict[str, Any], *path: str) -> Any:
    """`d[path[0]][path[1]]...`, or None where a key is missing."""
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _f(value: Any, fmt: str = ".3f", scale: float = 1.0) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "ok" if value else "FAIL"
    return format(value if fmt == "d" else value * scale, fmt)


def render(result: dict[str, Any]) -> str:
    s, ph = result["settings"], result["phases"]
    m = result["machine"]
    lines = [
        f"fthsdp recovery: {s['replicas']} replicas × {s['ranks']} ranks, {s['duration_s']:g} s "
        f"per run, kill every {s['kill_every_s']:g} s ({s['kill_mode']}), seed {s['seed']}",
        f"machine: {m['nproc']} cpus, load avg {m['load_avg_start']} at start, "
        f"{m['load_avg_end']} at end; work dir {result['work_dir']}",
    ]
    for name, phase in ph.items():
        if "error" in phase:
            lines.append(f"!! {name} failed: {phase['error']}")
    if s.get("overhead_only"):
        return "\n".join(lines + render_overhead(result))
    lines += _render_failures(result)
    return "\n".join(lines + render_overhead(result))


def _render_failures(result: dict[str, Any]) -> list[str]:
    ph, cmp_ = result["phases"], result["comparison"]
    ft, base, ff = ph.get("fthsdp", {}), ph.get("baseline", {}), ph.get("faultfree", {})
    stall_target = cmp_["stall_target_s"]
    targets = {
        "detection_s": f"≤ {result['targets']['detection_s']:g} s",
        "survivor_stall_s": "≤ step + 1 s"
        + ("" if stall_target is None else f" = {stall_target:.2f}"),
        "time_to_healthy_s": "—",
    }
    w = 30
    lines = [
        "",
        f"{'per failure (s)':<{w}}{'FT-HSDP (replica)':>24}{'baseline (job)':>24}   target",
        f"{'':<{w}}{'median':>9}{'max':>9}{'n':>6}{'median':>9}{'max':>9}{'n':>6}",
    ]
    for key, row in _per_failure_rows((ft, base), w):
        lines.append(f"{row}   {targets[key]}")
    pace = cmp_["survivor_pace_vs_fault_free"]
    lines.append(
        f"{'survivor pace / fault-free':<{w}}{_f(pace['fthsdp'], '.2f'):>24}"
        f"{_f(pace['baseline'], '.2f'):>24}   (steps/s, kill → victim back)"
    )
    lines.append(
        f"{'kills before 1st commit (left out)':<{w}}"
        f"{_f(dig(ft, 'failures', 'before_first_commit'), 'd'):>24}"
        f"{_f(dig(base, 'failures', 'before_first_commit'), 'd'):>24}"
    )
    ett, ratio = cmp_["ett"], cmp_["ett_ratio"]
    lines += [
        "",
        f"{'effective training time':<{w}}{'FT-HSDP':>10}{'baseline':>10}{'ratio':>8}"
        f"{'fault-free':>12}",
    ]
    for key, label in (
        ("time_launch", "ETT (time, launch→last commit)"),
        ("time_span", "  over 1st→last commit only"),
        ("time_wall", "  over the report's wall time"),
        ("report_replica_steps", "report ETT (replica-steps)"),
    ):
        ff_value = 1.0 if key.startswith("time") else ff.get("report_ett")
        lines.append(
            f"{label:<{w}}{_f(ett['fthsdp'][key]):>10}{_f(ett['baseline'][key]):>10}"
            f"{_f(ratio[key], '.2f'):>8}{_f(ff_value):>12}"
        )
    for key, label, fmt in (
        ("useful_replica_steps", "useful replica-steps", "d"),
        ("discarded_replica_steps", "thrown away by rollback", "d"),
        ("launch_span_s", "launch → last commit s", ".1f"),
        ("replica_steps_per_launch_s", "replica-steps / s", ".1f"),
        ("restarts", "replica restarts", "d"),
        ("startup_s", "launch → first commit s", ".1f"),
    ):
        lines.append(
            f"{label:<{w}}{_f(ft.get(key), fmt):>10}{_f(base.get(key), fmt):>10}{'':>8}"
            f"{_f(ff.get(key), fmt):>12}"
        )
    inv = " ".join(
        f"{name}:{'/'.join(_f(dig(run, 'invariants', i)) for i in ('I1', 'I2'))}"
        for name, run in (("fthsdp", ft), ("baseline", base), ("faultfree", ff))
    )
    lines.append(f"invariants I1/I2  {inv}")
    if "spares" in ph:
        lines += _render_spares(ph["spares"], ft, cmp_["ett"])
    return lines


def _per_failure_rows(runs: tuple[dict[str, Any], ...], w: int) -> list[tuple[str, str]]:
    """(metric, row): median, max and count of each per-failure metric, one column per run."""
    rows = []
    for key in FAILURE_METRICS:
        row = f"{key.removesuffix('_s').replace('_', ' '):<{w}}"
        for run in runs:
            st = dig(run, "failures", key) or {}
            n = f"{st.get('n', 0)}/{dig(run, 'failures', 'injected') or 0}"
            row += f"{_f(st.get('median')):>9}{_f(st.get('max')):>9}{n:>6}"
        rows.append((key, row))
    return rows


def _render_spares(sp: dict[str, Any], ft: dict[str, Any], ett: dict[str, Any]) -> list[str]:
    """The same schedule with warm spares, next to fresh restarts."""
    w = 30
    lines = [
        "",
        f"{'per failure (s)':<{w}}{'warm spares':>24}{'fresh processes':>24}",
        f"{'':<{w}}{'median':>9}{'max':>9}{'n':>6}{'median':>9}{'max':>9}{'n':>6}",
    ]
    lines += [row for _, row in _per_failure_rows((sp, ft), w)]
    lines.append(
        f"{'ETT (time, launch→last commit)':<{w}}{_f(ett['spares']['time_launch']):>24}"
        f"{_f(ett['fthsdp']['time_launch']):>24}"
    )
    inv = "/".join(_f(dig(sp, "invariants", i)) for i in ("I1", "I2"))
    lines.append(f"invariants I1/I2  spares:{inv}")
    return lines


def render_overhead(result: dict[str, Any]) -> list[str]:
    ph, cmp_ = result["phases"], result["comparison"]
    ff = ph.get("faultfree", {})
    w = 30
    lines: list[str] = []
    ov = cmp_["overhead"]
    ddp_each = ", ".join(_f(v, ".1f", 1e3) for v in ov["ddp_median_step_s_each"])
    lines += [
        "",
        f"{'fault-free step':<{w}}{'fthsdp':>10}{'DDP/gloo':>10}{'ratio':>8}   target",
        f"{'median step ms':<{w}}{_f(ov['fthsdp_median_step_s'], '.1f', 1e3):>10}"
        f"{_f(ov['ddp_median_step_s'], '.1f', 1e3):>10}{_f(ov['ratio'], '.3f'):>8}"
        f"   ≤ {result['targets']['overhead_ratio']:.2f}",
        f"{'  (report median_step_s)':<{w}}{_f(ov['fthsdp_report_median_step_s'], '.1f', 1e3):>10}"
        f"{'':>10}{_f(ov['ratio_report_median'], '.3f'):>8}",
        f"  DDP runs before/after: {ddp_each} ms",
    ]
    fph = dig(ff, "step_times", "phase_median_s") or {}
    dph = dig(ph, "ddp_before", "phase_median_s") or dig(ph, "ddp_after", "phase_median_s") or {}
    lines.append(
        "  fthsdp per step (median ms): "
        + ", ".join(
            f"{k} {_f(fph.get(k), '.1f', 1e3)}"
            for k in ("quorum", "ring", "exchange", "vote", "commit", "rest")
        )
        + "  (commit: gather inside the replica + optimizer; rest: data, forward, backward,"
        " the intra-replica sum)"
    )
    lines.append(
        "  DDP per step (median ms):    "
        + ", ".join(f"{k} {_f(v, '.1f', 1e3)}" for k, v in dph.items())
        + "  (backward includes the all-reduce)"
    )
    agree = cmp_["loss_agreement"]
    if agree and not agree["steps_compared"]:
        lines.append(
            f"  same model and data: not comparable, a replica missed step "
            f"{agree['full_prefix_steps']} of the fault-free run (late start)"
        )
    elif agree:
        lines.append(
            f"  same model and data: r0 loss == DDP rank-0 loss bitwise for the first "
            f"{agree['bitwise_equal_first_steps']}/{agree['steps_compared']} steps, "
            f"max |Δ| {agree['max_abs_diff']:.2e}"
        )
    rep = cmp_.get("overhead_repeats")
    if rep and len(rep["runs"]) > 1:
        each = ", ".join(_f(r["ratio"], ".3f") for r in rep["runs"])
        lines += [
            f"  {len(rep['runs'])} fault-free runs, each / mean(DDP before, after): {each}",
            f"  median ratio {_f(rep['ratio_median'], '.3f')} (min {_f(rep['ratio_min'], '.3f')},"
            f" max {_f(rep['ratio_max'], '.3f')}); DDP medians spread "
            f"{_f(rep['ddp_noise'], '.1%')} of their median (machine noise)",
        ]
    cost = rep.get("health_cost") if rep else None
    if cost:
        each = ", ".join(_f(r, ".3f") for r in cost["ratios"])
        lines.append(
            f"  health's own cost, each run with it / the run without it right after: {each}; "
            f"median {_f(cost['median'], '.3f')}"
        )
    return lines


# ---------------------------------------------------------------------------------------------
