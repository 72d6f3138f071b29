"""What a hung rank costs its replica, side by side with a killed one.

    python -m bench.teardown --runs 2 --duration-s 30 --json bench-teardown.json

Runs the demo job (3 replicas x 2 ranks, real processes) in one invocation, alternating:

1. `killed` (the baseline): one rank SIGKILLed (`kill_mode="process"`); the supervisor sees the
   exit at once, so this is what a replica's restart and catch-up cost on this machine.
2. `stopped`: one rank SIGSTOPped (`kill_mode="hang"`): its heartbeats stop, its node agent
   reports it, the eviction asks for a teardown, the replica's other rank exits and the agent
   kills the stopped one.
3. `stuck`: one rank stops making progress with its threads beating on (`--faults
   r1:1:<step>:hang`): no heartbeat is missed; the hang detector names it once its ring peers
   have waited the hang timeout (the demo's 3 s), then the same teardown.

Per failure: `down_s`, from the fault to the victim replica's first rank exit (what tore it
down); `healthy_s`, from the fault to its first commit after its restart; and for the injected
ones the report's detection (fault -> a quorum without it). Medians over all failures of a mode,
and `healthy_s` as a ratio to the killed baseline's median. Before teardowns a stopped rank's
replica sat in a gloo collective until its 60 s timeout (down after about 64 s, healthy after
about 82 s). Not a pass/fail test: the numbers move with the machine's load."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from fthsdp.bench.recovery import machine
from fthsdp.deploy.demo.events import ExitEvent, InjectEvent, RestartEvent, RunLog
from fthsdp.deploy.demo.run import DemoConfig, run_demo

MODES = ("killed", "stopped", "stuck")
_STUCK_STEP = 120


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2, help="runs per mode (default 2)")
    p.add_argument("--duration-s", type=float, default=30.0, help="training seconds per run")
    p.add_argument("--kill-every-s", type=float, default=12.0, help="seconds between failures")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--work-dir", type=Path, help="run directories go under it (default: temp)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.duration_s <= 0 or args.kill_every_s <= 0:
        p.error("--runs must be >= 1, --duration-s and --kill-every-s positive")
    return args


def _config(mode: str, run_dir: Path, args: argparse.Namespace) -> DemoConfig:
    injected = mode != "stuck"
    return DemoConfig(
        replicas=3,
        ranks=2,
        duration=timedelta(seconds=args.duration_s),
        kill_every=timedelta(seconds=args.kill_every_s) if injected else None,
        kill_mode="process" if mode == "killed" else "hang",
        faults="" if injected else f"r1:1:{_STUCK_STEP}:hang",
        run_dir=run_dir,
        live=False,
    )


def _after(log: RunLog, replica: str, t: float) -> dict[str, float | None]:
    """When `replica` went down after the fault at `t`, and when it committed after restarting."""
    exits = [e.t for e in log.of_type(ExitEvent) if e.replica == replica and e.t > t]
    restarts = [e.t for e in log.of_type(RestartEvent) if e.replica == replica and e.t > t]
    back = next((c.t for c in log.commits(replica) if restarts and c.t > restarts[0]), None)
    return {
        "down_s": None if not exits else round(exits[0] - t, 3),
        "healthy_s": None if back is None else round(back - t, 3),
    }


def measure(mode: str, run_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One demo run; one row per failure."""
    report = run_demo(_config(mode, run_dir, args))
    log = RunLog.load(run_dir)
    if mode == "stuck":
        marker = run_dir / "faults" / f"fault-r1-1-{_STUCK_STEP}-hang"
        if not marker.exists():
            return []
        return [{"replica": "r1", "detection_s": None, **_after(log, "r1", marker.stat().st_mtime)}]
    rows = []
    for failure, inject in zip(report["failures"], log.of_type(InjectEvent), strict=False):
        assert inject.replica == failure["replica"]
        rows.append(
            {
                "replica": inject.replica,
                "detection_s": failure["detection_s"],
                **_after(log, inject.replica, inject.t),
            }
        )
    return rows


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 3) if values else None


def summarise(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    base = _median(rows["killed"], "healthy_s")
    out = {}
    for mode in MODES:
        healthy = _median(rows[mode], "healthy_s")
        out[mode] = {
            "failures": len(rows[mode]),
            "detection_s": _median(rows[mode], "detection_s"),
            "down_s": _median(rows[mode], "down_s"),
            "down_s_max": max((r["down_s"] for r in rows[mode] if r["down_s"]), default=None),
            "healthy_s": healthy,
            "healthy_vs_killed": None if not (base and healthy) else round(healthy / base, 2),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fthsdp-bench-teardown-"))
    rows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for run in range(args.runs):
        for mode in MODES:
            rows[mode] += measure(mode, work / f"{mode}-{run}", args)
    summary = summarise(rows)
    print(f"{'mode':<8} {'n':>3} {'detect s':>9} {'down s':>8} {'healthy s':>10} {'vs killed':>10}")
    for mode, s in summary.items():
        print(
            f"{mode:<8} {s['failures']:>3} {s['detection_s']!s:>9} {s['down_s']!s:>8} "
            f"{s['healthy_s']!s:>10} {s['healthy_vs_killed']!s:>10}"
        )
    if args.json:
        document = {"summary": summary, "rows": rows, "args": vars(args), "machine": machine()}
        args.json.write_text(json.dumps(document, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
