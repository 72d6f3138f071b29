"""Culprit precision and recall of the health service on real `fthsdp demo` runs.

    python -m bench.rca_live --runs 6 --duration 40 --json bench-rca-live.json

`bench.rca` scores the detectors on emulated ranks; this runs the demo job (R replicas x W ranks,
real processes, real signals, the real health service) N times and scores the incidents the
service reported against the faults that were actually injected. Each run has one kill mode of
the supervisor (two injections, `--kill-mode` cycling through `slow`, `hang`, `process`,
`replica`) and two planned rank faults (`--faults`, alternating a `hang` and a `slow` fault
point), so four faults per run where the demo allows it:

| fault        | how                                             | expected incident          |
|--------------|-------------------------------------------------|----------------------------|
| `process`    | SIGKILL one rank                                | fail_stop or hang          |
| `replica`    | SIGKILL every rank of a replica                 | fail_stop or hang          |
| `hang`       | SIGSTOP one rank                                | fail_stop or hang          |
| `hang_point` | `replica:rank:step:hang`: blocks, beats go on   | hang                       |
| `slow_point` | `replica:rank:step:slow:8`: 80 ms late, 8 s     | slow_rank                  |
| `slow`       | the replica throttled 12 s (SIGSTOP/SIGCONT)    | fail_slow                  |

What was injected comes from the run log (a kill mode's injection is deferred while it would take
the job below its floor, and skipped in the run's last stretch) and from the planned faults'
marker files (a fault fires when its rank reaches its step; the marker's time is the moment;
a replica that was down at that step never fires it). Planned faults are placed by step at an
assumed `--steps-per-s`; only the recorded times count.

Matching (`match`, a pure function): an incident detects a fault when its kind is expected for
the fault, it names the fault's replica (and the fault's rank, where both name one) and it was
detected within `--window-s` after the injection (for a slow fault, also at most `SLOW_LAG_S`
after the slowness ended; a throttle of a replica right after its previous one ended extends
that one: the detectors see one episode). Follow-on incidents of the same fault count as
matched, not as false alarms, without detecting it: the other ranks of a replica that went down
(a kill, a stop, a hang's teardown), fail_stop after a hang's teardown, the fail_slow of a slow
rank's own replica, a slow_rank of a throttled replica. An incident matched to no fault is a
false alarm. A fault left undetected because a later fault took its replica down while it could
still have been named (a slow rank's replica killed 2 s in) is "cut short": neither detected nor
missed. Reported per fault kind and in total: injected, cut short, detected, missed, recall
(detected / (injected - cut short)), precision (matched incidents / all incidents), false
alarms per 1,000 replica-steps (the report's `possible_replica_steps`: steps committed x
replicas), and every false alarm with its kind, culprit, time relative to the latest injection
and evidence. Targets (the issue): precision >= 0.95, recall >= 0.95, <= 0.3 false alarms per
1,000 replica-steps. Not a pass/fail test: the numbers move with the machine's load."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from fthsdp.services.common import logs

KINDS = ("process", "replica", "hang", "hang_point", "slow_point", "slow")
"""Fault kinds: the supervisor's kill modes by name, and the planned fault points `hang` and
`slow` as `hang_point` and `slow_point`."""

EXPECTED: Mapping[str, frozenset[str]] = {
    "process": frozenset({"fail_stop", "hang"}),
    "replica": frozenset({"fail_stop", "hang"}),
    "hang": frozenset({"fail_stop", "hang"}),
    "hang_point": frozenset({"hang"}),
    "slow_point": frozenset({"slow_rank"}),
    "slow": frozenset({"fail_slow"}),
}
"""Incident kinds that detect a fault of each kind. A SIGSTOPped rank stops beating (fail_stop)
and its ring peers wait on it (hang), whichever fires first; a killed one likewise."""

FOLLOW_ON: Mapping[str, frozenset[str]] = {
    **EXPECTED,
    "hang_point": frozenset({"hang", "fail_stop"}),
    "slow_point": frozenset({"slow_rank", "fail_slow"}),
    "slow": frozenset({"fail_slow", "slow_rank"}),
}
"""Incident kinds that a fault of each kind explains on its own replica (matched, not false)."""

REPLICA_GOES_DOWN = frozenset({"process", "replica", "hang", "hang_point"})
"""Faults after which the whole replica is torn down: an incident naming any of its ranks
follows from it. After a slow rank, its replica lives on: another rank named is a wrong culprit."""

SLOW_POINT_S = 8.0
"""How long a planned `slow` fault lasts here: the slow-rank detector needs the rank last in 34
of its ring's last 40 collectives (~4 s at the slowed ~8 steps/s), and the fault should be over
before the next injection."""
WINDOW_S = 15.0
"""How long after a fault an incident may name it (`--window-s`): a fail-stop is named within
about a second, a hang after the demo's 3 s hang timeout, a throttle after the fail-slow settle
and persistence (up to ~8 s), with room for a loaded host."""
SLOW_PERIOD_S = 12.0
"""`deploy.demo.supervisor.SLOW_PERIOD_S` (not imported: the matching stays free of the demo)."""
SLOW_LAG_S = 3.0
"""The longest a slow fault's detection may lag its end: the detectors judge the last few
seconds of steps (fail-slow: >= 5 steps spanning >= 2 s; slow-rank: most of the last 40
collectives), so an incident later than this after the slowness ended saw something else."""
MERGE_GAP_S = 2.0
"""A throttle of a replica that starts less than this after its previous throttle ended is
the same slow episode to any detector (the replica never ran at its speed in between): the
two count as one fault. The supervisor may pick the same replica again as soon as its
throttle ends."""
_KILL_MODES = ("slow", "hang", "process", "replica")
_PLANNED = (("slow_point", "hang_point"), ("hang_point", "slow_point"))


@dataclass(frozen=True, kw_only=True, slots=True)
class InjectedFault:
    """One fault that was actually injected."""

    kind: str
    """One of KINDS."""
    replica: str
    rank: int | None
    """The faulty rank; None for the whole replica (`replica`, `slow`)."""
    t: float
    """Unix seconds of the injection."""
    until: float | None = None
    """For a slow fault, Unix seconds when the slowness ended: a detection later than
    `SLOW_LAG_S` after it is no detection of it (None: the window alone bounds it)."""

    def window_end(self, window_s: float) -> float:
        end = self.t + window_s
        return end if self.until is None else min(end, self.until + SLOW_LAG_S)


@dataclass(slots=True)
class FaultResult:
    """What the incidents said of one fault."""

    fault: InjectedFault
    detected_by: int | None = None
    """Index of the first incident that detected it (None: missed)."""
    matched: list[int] = field(default_factory=list)
    """Indices of every incident matched to it (detections and follow-ons)."""
    cut_short_by: InjectedFault | None = None
    """A later fault that took this undetected fault's replica down while it could still have
    been named: it never ran its course, so it counts neither as detected nor as missed."""


@dataclass(frozen=True, slots=True)
class Matching:
    """`match`'s verdict."""

    faults: list[FaultResult]
    false_alarms: list[int]
    """Indices of incidents matched to no fault."""


def _rank_fits(fault: InjectedFault, rank: int | None) -> bool:
    return fault.rank is None or rank is None or rank == fault.rank


def _relation(fault: InjectedFault, incident: Mapping[str, Any], window_s: float) -> int:
    """2: the incident detects the fault; 1: it follows from it; 0: unrelated."""
    at = float(incident["detected_at"])
    if incident["replica_id"] != fault.replica or not fault.t <= at <= fault.window_end(window_s):
        return 0
    kind, rank = incident["kind"], incident.get("rank")
    fits = _rank_fits(fault, rank)
    if kind in EXPECTED[fault.kind] and fits:
        return 2
    if kind in FOLLOW_ON[fault.kind] and (fits or fault.kind in REPLICA_GOES_DOWN):
        return 1
    return 0


def match(
    faults: Sequence[InjectedFault],
    incidents: Sequence[Mapping[str, Any]],
    window_s: float = WINDOW_S,
) -> Matching:
    """Assigns each incident (`detected_at`, `kind`, `replica_id`, `rank`) to at most one fault:
    one it detects before one it merely follows from, then the latest injected before it. A
    fault is detected when an incident assigned to it detects it."""
    results = [FaultResult(fault=f) for f in faults]
    false_alarms = []
    order = sorted(range(len(incidents)), key=lambda i: float(incidents[i]["detected_at"]))
    for i in order:
        related = [(_relation(r.fault, incidents[i], window_s), r.fault.t, r) for r in results]
        best = max((x for x in related if x[0]), key=lambda x: (x[0], x[1]), default=None)
        if best is None:
            false_alarms.append(i)
            continue
        relation, _, result = best
        result.matched.append(i)
        if relation == 2 and result.detected_by is None:
            result.detected_by = i
    for result in results:
        if result.detected_by is None:
            result.cut_short_by = _cut_short_by(result.fault, faults, window_s)
    return Matching(faults=results, false_alarms=false_alarms)


def _cut_short_by(
    fault: InjectedFault, faults: Sequence[InjectedFault], window_s: float
) -> InjectedFault | None:
    """The first later fault that took `fault`'s replica down inside its window (for a slow
    fault: before its slowness ended), if any."""
    end = fault.window_end(window_s) if fault.until is None else fault.until
    return next(
        (
            f
            for f in sorted(faults, key=lambda f: f.t)
            if f is not fault
            and f.replica == fault.replica
            and f.kind in REPLICA_GOES_DOWN
            and fault.t < f.t <= end
        ),
        None,
    )


def injected_faults(
    report: Mapping[str, Any], t0: float, planned: Sequence[InjectedFault]
) -> list[InjectedFault]:
    """The report's injected failures (`t` is relative to the run's start `t0`) of the kill
    modes this bench scores, and the planned faults that fired, oldest first; a throttle
    right after the same replica's previous one extends it (`MERGE_GAP_S`)."""
    kills: list[InjectedFault] = []
    throttles: dict[str, int] = {}  # replica -> index of its latest throttle in kills
    for f in sorted(report.get("failures", []), key=lambda f: float(f["t"])):
        if f["mode"] not in KINDS or f["replica"] is None:
            continue
        t = t0 + float(f["t"])
        fault = InjectedFault(kind=f["mode"], replica=f["replica"], rank=f["rank"], t=t)
        if f["mode"] == "slow":
            fault = replace(fault, until=t + SLOW_PERIOD_S)
            last = throttles.get(f["replica"])
            if last is not None and t - (kills[last].until or t) < MERGE_GAP_S:
                # The same episode, longer.
                kills[last] = replace(kills[last], until=fault.until)
                continue
            throttles[f["replica"]] = len(kills)
        kills.append(fault)
    return sorted([*kills, *planned], key=lambda f: f.t)


def planned_faults(faults_dir: Path) -> list[InjectedFault]:
    """The planned `hang` and `slow` faults that fired, from their marker files
    (`fault-<replica>-<rank>-<step>-<point>`, touched as the fault fires); a `slow` one lasts
    `SLOW_POINT_S`, as this bench plans them."""
    out = []
    for marker in sorted(faults_dir.glob("fault-*")):
        parts = marker.name.split("-")
        if len(parts) != 5 or parts[4] not in ("hang", "slow"):
            continue
        t = marker.stat().st_mtime
        out.append(
            InjectedFault(
                kind=f"{parts[4]}_point",
                replica=parts[1],
                rank=int(parts[2]),
                t=t,
                until=t + SLOW_POINT_S if parts[4] == "slow" else None,
            )
        )
    return out


def score_run(
    report: Mapping[str, Any],
    *,
    t0: float,
    planned: Sequence[InjectedFault],
    window_s: float = WINDOW_S,
) -> dict[str, Any]:
    """One run's faults, matched incidents and false alarms, JSON-ready (times relative to
    `t0`)."""
    faults = injected_faults(report, t0, planned)
    merged = sum(1 for f in report.get("failures", []) if f["mode"] in KINDS) - sum(
        1 for f in faults if f.kind in _KILL_MODES
    )
    incidents = list(report.get("incidents", []))
    verdict = match(faults, incidents, window_s)

    def rel(t: float) -> float:
        return round(t - t0, 3)

    rows = []
    for result in verdict.faults:
        first = None if result.detected_by is None else incidents[result.detected_by]
        cut = result.cut_short_by
        rows.append(
            {
                **asdict(result.fault),
                "t": rel(result.fault.t),
                "until": None if result.fault.until is None else rel(result.fault.until),
                "detected": first is not None,
                "cut_short_by": None
                if cut is None
                else f"{cut.kind} {cut.replica} at {rel(cut.t)}",
                "latency_s": None
                if first is None
                else round(float(first["detected_at"]) - result.fault.t, 3),
                "detected_as": None if first is None else first["kind"],
                "matched": [_brief(incidents[i], t0) for i in result.matched],
            }
        )
    alarms = []
    for i in verdict.false_alarms:
        incident = incidents[i]
        at = float(incident["detected_at"])
        before = [f for f in faults if f.t <= at]
        alarms.append(
            {
                **_brief(incident, t0),
                "since_last_fault_s": round(at - before[-1].t, 3) if before else None,
                "last_fault": None if not before else f"{before[-1].kind} {before[-1].replica}",
                "summary": incident.get("summary"),
                "evidence": incident.get("evidence"),
            }
        )
    summary = report.get("summary", {})
    return {
        "faults": rows,
        "false_alarms": alarms,
        "incidents": len(incidents),
        "merged_throttles": merged,
        "replica_steps": int(summary.get("possible_replica_steps", 0)),
    }


def _brief(incident: Mapping[str, Any], t0: float) -> dict[str, Any]:
    return {
        "kind": incident["kind"],
        "replica": incident["replica_id"],
        "rank": incident.get("rank"),
        "t": round(float(incident["detected_at"]) - t0, 3),
    }


def summarise(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per fault kind and in total: injected, detected, missed, recall, matched incidents,
    median latency; precision and false alarms per 1,000 replica-steps in total."""
    faults = [f for run in runs for f in run["faults"]]
    per_kind = {}
    for kind in KINDS:
        mine = [f for f in faults if f["kind"] == kind]
        per_kind[kind] = _counts(mine)
    incidents = sum(run["incidents"] for run in runs)
    alarms = sum(len(run["false_alarms"]) for run in runs)
    steps = sum(run["replica_steps"] for run in runs)
    total = _counts(faults)
    total.update(
        incidents=incidents,
        false_alarms=alarms,
        precision=None if incidents == 0 else round((incidents - alarms) / incidents, 3),
        replica_steps=steps,
        false_alarms_per_1000_steps=None if steps == 0 else round(1000 * alarms / steps, 3),
    )
    return {"per_kind": per_kind, "total": total}


def _counts(faults: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    detected = [f for f in faults if f["detected"]]
    cut = [f for f in faults if f["cut_short_by"] is not None]
    latencies = [f["latency_s"] for f in detected]
    scored = len(faults) - len(cut)
    return {
        "injected": len(faults),
        "cut_short": len(cut),
        "detected": len(detected),
        "missed": scored - len(detected),
        "recall": None if not scored else round(len(detected) / scored, 3),
        "matched_incidents": sum(len(f["matched"]) for f in faults),
        "median_latency_s": round(statistics.median(latencies), 3) if latencies else None,
    }


# ---------------------------------------------------------------------------------------------
# Running the demos


def schedule(run: int, args: argparse.Namespace) -> tuple[str, str]:
    """Run `run`'s kill mode and planned faults: one early (at ~10% of the duration, before the
    first injection) and one late (at ~80%, after the last), on replicas 1 and 2. With the
    `slow` kill mode the early one is the hang: a throttle that picks the slow rank's replica
    right after it would be the same slow episode to the fail-slow detector (it names a replica
    again only after it ran at its speed for a while), so it could not be told apart."""
    mode = _KILL_MODES[run % len(_KILL_MODES)]
    planned = _PLANNED[1] if mode == "slow" else _PLANNED[(run + 1) % len(_PLANNED)]
    duration = args.duration
    faults = []
    for point, (at, replica) in zip(planned, ((0.1, 1), (0.8, 2)), strict=True):
        step = max(2, round(at * duration * args.steps_per_s))
        where = f"r{replica % args.replicas}:{(run + replica) % args.ranks}:{step}"
        faults.append(
            f"{where}:slow:{SLOW_POINT_S:g}" if point == "slow_point" else f"{where}:hang"
        )
    return mode, ",".join(faults)


def kill_every(duration: float) -> float:
    """Two injections of the kill mode: the demo injects none in its last stretch
    (min(10 s, a quarter of the run)), and none at the start."""
    return (duration - min(10.0, duration / 4)) / 2.5


def run_once(run: int, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Runs the demo of schedule `run` into `run_dir` and scores it."""
    from fthsdp.deploy.demo.run import DemoConfig, run_demo

    mode, faults = schedule(run, args)
    config = DemoConfig(
        replicas=args.replicas,
        ranks=args.ranks,
        duration=timedelta(seconds=args.duration),
        kill_every=timedelta(seconds=kill_every(args.duration)),
        kill_mode=mode,
        faults=faults,
        seed=args.seed + run,
        run_dir=run_dir,
        live=False,
    )
    run_demo(config)
    return {**score_dir(run, run_dir, args.window_s), "faults_spec": faults}


def score_dir(run: int, run_dir: Path, window_s: float) -> dict[str, Any]:
    """Scores a finished run directory (its `report.json`, run log and fault markers)."""
    from fthsdp.deploy.demo.events import RunLog

    report = json.loads((run_dir / "report.json").read_text())
    log = RunLog.load(run_dir)
    t0 = log.run.t if log.run is not None else 0.0
    planned = planned_faults(run_dir / "faults")
    scored = score_run(report, t0=t0, planned=planned, window_s=window_s)
    return {
        "run": run,
        "run_dir": str(run_dir),
        "kill_mode": log.run.kill_mode if log.run is not None else None,
        "planned_fired": [f"{f.kind} {f.replica}:{f.rank}" for f in planned],
        "median_step_s": report.get("summary", {}).get("median_step_s"),
        **scored,
    }


def print_table(summary: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> None:
    print(
        f"\n{'fault kind':<11} {'injected':>8} {'cut short':>9} {'detected':>8} {'missed':>6} "
        f"{'recall':>7} {'matched inc':>11} {'latency s':>9}"
    )
    rows = [*summary["per_kind"].items(), ("total", summary["total"])]
    for kind, s in rows:
        print(
            f"{kind:<11} {s['injected']:>8} {s['cut_short']:>9} {s['detected']:>8} "
            f"{s['missed']:>6} {_num(s['recall']):>7} {s['matched_incidents']:>11} "
            f"{_num(s['median_latency_s']):>9}"
        )
    t = summary["total"]
    print(
        f"incidents {t['incidents']}, false alarms {t['false_alarms']}, precision "
        f"{_num(t['precision'])}, false alarms per 1,000 replica-steps "
        f"{_num(t['false_alarms_per_1000_steps'])} ({t['replica_steps']} replica-steps)"
    )
    print("targets: precision >= 0.95, recall >= 0.95, <= 0.3 false alarms per 1,000 steps")
    for run in runs:
        for f in run["faults"]:
            where = f"{f['kind']} {f['replica']}:{f['rank']} at {f['t']} s"
            if f["cut_short_by"] is not None:
                print(f"run {run['run']}: CUT SHORT {where} by {f['cut_short_by']} s")
            elif not f["detected"]:
                print(f"run {run['run']}: MISSED {where}")
        for a in run["false_alarms"]:
            print(
                f"run {run['run']}: FALSE ALARM {a['kind']} {a['replica']}:{a['rank']} at "
                f"{a['t']} s ({a['since_last_fault_s']} s after {a['last_fault']}): "
                f"{a['summary']}"
            )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.rca_live", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--runs", type=int, default=6, help="demo runs (default 6)")
    p.add_argument(
        "--start", type=int, default=0,
        help="index of the first run: its schedule, seed offset and run-<i> directory; e.g. "
        "--start 2 --runs 2 runs only the process and replica schedules (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--duration", type=float, default=40.0,
        help="training seconds per run, from when every replica is healthy (default 40)",
    )  # fmt: skip
    p.add_argument("--replicas", type=int, default=3, help="replicas per run (default 3)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica (default 2)")
    p.add_argument(
        "--seed", type=int, default=0,
        help="run i uses seed + i for the injector's choices and the model (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--run-dir", type=Path,
        help="run directories go under it as run-<i> (default: a new temporary directory)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="write every fault, incident and count here")
    p.add_argument(
        "--rescore", action="store_true",
        help="run no demo: score the run-<i> directories already under --run-dir",
    )  # fmt: skip
    p.add_argument(
        "--window-s", type=float, default=WINDOW_S,
        help=f"an incident matches a fault detected this long after it (default {WINDOW_S:g})",
    )  # fmt: skip
    p.add_argument(
        "--steps-per-s", type=float, default=20.0,
        help="assumed step rate, only to place the planned faults' steps: below an unloaded "
        "run's ~23 for the stalls the other faults cause (default 20)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if (
        args.runs < 1
        or args.start < 0
        or args.duration <= 0
        or args.window_s <= 0
        or args.steps_per_s <= 0
    ):
        p.error("--runs >= 1, --start >= 0; --duration, --window-s, --steps-per-s positive")
    if args.replicas < 3 or args.ranks < 1:
        p.error("--replicas must be >= 3 (the floor leaves room for a fault), --ranks >= 1")
    if args.rescore and args.run_dir is None:
        p.error("--rescore needs --run-dir")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure("WARNING")  # the demo's own warnings (its embedded quorum service's)
    work = args.run_dir or Path(tempfile.mkdtemp(prefix="fthsdp-bench-rca-live-"))
    runs = []
    for run in range(args.start, args.start + args.runs):
        run_dir = work / f"run-{run}"
        if args.rescore:
            result = score_dir(run, run_dir, args.window_s)
        else:
            result = run_once(run, run_dir, args)
        runs.append(result)
        print(
            f"run {run}: kill mode {result['kill_mode']}, planned faults fired "
            f"{result['planned_fired']}: {len(result['faults'])} faults, {result['incidents']} "
            f"incidents, {len(result['false_alarms'])} false alarms",
            flush=True,
        )
    summary = summarise(runs)
    print_table(summary, runs)
    if args.json:
        from fthsdp.bench.recovery import machine

        document = {
            "benchmark": "rca_live",
            "summary": summary,
            "runs": runs,
            "args": vars(args),
            "machine": machine(),
        }
        args.json.write_text(json.dumps(document, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
