"""Fail-slow mitigation on the demo: the job's samples/s with one replica slowed f times, per
policy, against no mitigation and against the ideal.

    python -m bench.failslow --json bench-failslow.json     # ~10 min: f = 1.5, 2, 3; 4 policies
    python -m bench.failslow --quick                         # ~3 min: f = 2; off and auto

One `fthsdp demo` per policy (`--failslow-policy`, all in this one invocation, side by side):
R replicas x W ranks, `--micro-steps` micro-steps per replica and step, no injected failures
(`--no-kills`), no durable checkpoints. Once every replica commits, this process throttles one
replica (`--victim`, default the last; `bench.throttle`: a CFS CPU quota, cgroup v2 or v1, where
available, else SIGSTOP/SIGCONT duty cycling) through a fixed schedule, the same in every run:

  warm-up | unthrottled windows | per f: settle, throttled windows, recover | (auto only) flaps

Everything is read afterwards from the run's logs (`replicas/<r>.jsonl`, `deploy.demo.events`)
by `bench.failslow_analysis`, whose doc says how each figure is computed: the job's samples/s
(each committed step once), each replica's own speed, the achieved slowdown f', retained (vs
the same run unthrottled right before and after), the ideal two ways, the reaction time and,
for the flaps, assignment changes, planner decisions and thrashing.

Prints a table and writes JSON (`--json`, and `failslow.json` in the work directory). Not a
pass/fail test: the figures move with the machine's load; the ratios are what to read."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from fthsdp.bench.failslow_analysis import (
    Segment,
    Span,
    compare,
    decisions_in,
    flap_verdict,
    measure,
    planner_decisions,
)
from fthsdp.bench.throttle import CPU_PERIOD_US, ReplicaThrottle, read_procs
from fthsdp.deploy.demo.events import CommitEvent, JsonlTail, RunLog

SLOWDOWNS = (1.5, 2.0, 3.0)
POLICIES = ("off", "evict", "rebalance", "auto")
STATUS_EVERY_S = 2.0
MARGIN_S = 60.0
"""The demo's `--duration` beyond the schedule: it is stopped (SIGINT) once the schedule is
done, so it never reaches its end phase while measured."""
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# The schedule


def plan(args: argparse.Namespace, *, flaps: bool) -> list[Segment]:
    """The schedule of one run: the sweep over `args.slowdowns`, then the flaps if asked."""
    measured = args.windows * args.window_s
    out = [
        Segment(name="warm-up", kind="warmup", factor=1.0, seconds=args.warmup_s),
        Segment(
            name="unthrottled", kind="base", factor=1.0, seconds=measured, windows=args.windows
        ),
    ]
    for f in args.slowdowns:
        out += [
            Segment(name=f"settle {f:g}x", kind="settle", factor=f, seconds=args.settle_s),
            Segment(
                name=f"slow {f:g}x", kind="slow", factor=f, seconds=measured, windows=args.windows
            ),
            Segment(
                name=f"recover {f:g}x",
                kind="recover",
                factor=1.0,
                seconds=args.recover_s,
                windows=1,
                skip_s=args.recover_s / 2,
            ),
        ]
    if flaps:
        for i in range(1, args.flaps + 1):
            f = args.flap_factor
            t = args.flap_s
            out += [
                Segment(name=f"on {i}", kind="flap-on", factor=f, seconds=t, windows=1),
                Segment(name=f"off {i}", kind="flap-off", factor=1.0, seconds=t, windows=1),
            ]
        out.append(Segment(name="tail", kind="tail", factor=1.0, seconds=args.flap_s, windows=1))
    return out


# ---------------------------------------------------------------------------------------------
# Polling `fthsdp status` for the planner's decisions


def read_status(health_url: str, token_file: Path) -> dict[str, Any] | None:
    """`fthsdp status --json` of a running demo, in this process (its own argument parser, so
    options added later keep their defaults); None when it cannot be read."""
    from fthsdp.deploy import status_cmd

    parser = argparse.ArgumentParser()
    status_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["status", "--health-url", health_url, "--token-file", str(token_file), "--json"]
    )
    out = io.StringIO()
    try:
        if status_cmd.run(args, out) != 0:
            return None
    except Exception:  # a poll that fails is counted, never fatal to the run
        return None
    try:
        parsed = json.loads(out.getvalue())
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


class StatusLog:
    """Distinct planner decisions and quorums seen while polling `fthsdp status`."""

    def __init__(self) -> None:
        self.decisions: dict[str, dict[str, Any]] = {}
        self.quorums: dict[str, dict[str, Any]] = {}
        self.polls = 0
        self.failures = 0

    def add(self, status: dict[str, Any] | None) -> None:
        if status is None:
            self.failures += 1
            return
        self.polls += 1
        for d in planner_decisions(status):
            self.decisions.setdefault(json.dumps(d, sort_keys=True, default=str), d)
        for q in status.get("quorum", {}).get("quorums", []):
            self.quorums.setdefault(str(q.get("quorum_id")), q)

    def as_json(self) -> dict[str, Any]:
        return {
            "polls": self.polls,
            "failed_polls": self.failures,
            "decisions": list(self.decisions.values()),
            "quorums": sorted(self.quorums.values(), key=lambda q: q.get("formed_at") or 0),
        }


# ---------------------------------------------------------------------------------------------
# Running a demo


def demo_flags() -> tuple[bool, set[str]]:
    """Whether `fthsdp demo` takes `--micro-steps`, and the policies `--failslow-policy` takes
    (only `off`, meaning no flag, when it has none)."""
    text = subprocess.run(
        [sys.executable, "-m", "fthsdp.deploy.cli", "demo", "--help"],
        capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "1000"},
    ).stdout  # fmt: skip
    micro = "--micro-steps" in text
    if "--failslow-policy" not in text:
        return micro, {"off"}
    choices = re.search(r"--failslow-policy \{([^}]*)\}", text)
    return micro, set(choices.group(1).split(",")) if choices else set(POLICIES)


class DemoProcess:
    """`fthsdp demo` as a child process of its own session, stopped with SIGINT (its launcher
    then stops every process it started); whatever is left that names the run directory on its
    command line is killed by pid."""

    def __init__(self, argv: list[str], run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=False)
        self.out_path = run_dir / "bench-demo.out"
        self._out = self.out_path.open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.killed_leftovers = 0

    def running(self) -> bool:
        return self.proc.poll() is None

    def health_url(self) -> str | None:
        text = self.out_path.read_text(errors="replace")
        found = re.search(r"health dashboard: (\S+)/dashboard", text)
        return found.group(1) if found else None

    def wait_training(self, replicas: Sequence[str], timeout_s: float) -> None:
        """Until a step is committed with every replica contributing."""
        tails = {r: JsonlTail(self.run_dir / "replicas" / f"{r}.jsonl", strict=False)
                 for r in replicas}  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(f"the demo exited ({self.proc.returncode}): {self.out_path}")
            for tail in tails.values():
                for event in tail.poll():
                    if isinstance(event, CommitEvent) and set(event.trained) >= set(replicas):
                        return
            time.sleep(0.25)
        raise TimeoutError(f"no step with every replica within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        mine = str(self.run_dir)
        for pid, p in read_procs().items():
            if pid != os.getpid() and any(mine in a for a in p.argv):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                    self.killed_leftovers += 1


def demo_argv(
    args: argparse.Namespace, policy: str, run_dir: Path, duration_s: float, micro: bool
) -> list[str]:
    argv = [
        sys.executable, "-m", "fthsdp.deploy.cli", "demo",
        "--replicas", str(args.replicas), "--ranks", str(args.ranks),
        "--no-kills", "--no-live", "--progress-every", "30",
        "--duration", f"{duration_s:.0f}", "--seed", str(args.seed),
        "--durable-every-steps", str(args.durable_every_steps),
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    if micro:
        argv += ["--micro-steps", str(args.micro_steps)]
    if policy != "off" or args.accepted != {"off"}:
        argv += ["--failslow-policy", policy]
    return argv


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _stamp() -> str:
    return time.strftime("%H:%M:%S")


def run_policy(policy: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One demo under `policy` through the whole schedule, measured."""
    segments = plan(args, flaps=policy == args.flap_policy and args.flaps > 0)
    total = sum(s.seconds for s in segments)
    run_dir = root / policy
    replicas = [f"r{i}" for i in range(args.replicas)]
    argv = demo_argv(args, policy, run_dir, total + MARGIN_S, args.micro)
    print(f"[{_stamp()}] {policy}: {shlex.join(argv[1:])}", flush=True)
    t_start, load_start = time.monotonic(), _load()
    demo = DemoProcess(argv, run_dir)
    spans: list[Span] = []
    status = StatusLog()
    throttle = ReplicaThrottle(args.victim, backend=args.throttle, period_s=args.period_ms / 1e3)
    try:
        demo.wait_training(replicas, START_TIMEOUT_S)
        startup = time.monotonic() - t_start
        print(f"[{_stamp()}] {policy}: training after {startup:.0f} s; schedule {total:.0f} s")
        with throttle:
            spans = drive(segments, throttle, demo, status)
        print(f"[{_stamp()}] {policy}: schedule done", flush=True)
    finally:
        throttle.close()
        demo.stop()
    result = {
        "policy": policy,
        "run_dir": str(run_dir),
        "argv": argv,
        "startup_s": startup,
        "wall_s": time.monotonic() - t_start,
        "spans": [{**asdict(s.segment), "t0": s.t0, "t1": s.t1} for s in spans],
        "throttle": throttle.report(),
        "status": status.as_json(),
        "killed_leftovers": demo.killed_leftovers,
        "load_avg": [load_start, _load()],
    }
    result.update(measure(RunLog.load(run_dir), spans, args.victim, replicas))
    return result


def drive(
    segments: Sequence[Segment], throttle: ReplicaThrottle, demo: DemoProcess, status: StatusLog
) -> list[Span]:
    """Runs the schedule, polling the demo's status meanwhile."""
    spans = []
    url = None
    next_status = 0.0
    for segment in segments:
        throttle.set_factor(segment.factor)
        t0, end = time.time(), time.monotonic() + segment.seconds
        while (left := end - time.monotonic()) > 0:
            if not demo.running():
                raise RuntimeError(f"the demo exited during {segment.name}: {demo.out_path}")
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + STATUS_EVERY_S
                url = url or demo.health_url()
                if url:
                    status.add(read_status(url, demo.run_dir / "token"))
            time.sleep(min(0.25, left))
        spans.append(Span(segment=segment, t0=t0, t1=time.time()))
    throttle.set_factor(1.0)
    return spans


# ---------------------------------------------------------------------------------------------
# Output


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def render(result: Mapping[str, Any]) -> str:
    s = result["settings"]
    runs = result["runs"]
    lines = [
        f"fail-slow: {s['replicas']} replicas x {s['ranks']} ranks, "
        f"{s['micro_steps'] if s['micro'] else 1} micro-steps each, {s['victim']} throttled "
        f"({result['throttle_backend']}, {_cycle_ms(result['throttle_backend'], s):g} ms cycles)",
        "unthrottled samples/s: "
        + ", ".join(
            f"{p} {_f(r.get('base', {}).get('samples_per_s'), '.0f')}" for p, r in runs.items()
        ),
        "",
        f"{'f':>4} {'policy':<10} {'samples/s':>9} {'retained':>8} {'achieved f':>10} "
        f"{'vs off':>6} {'ideal':>5} {'vs ideal':>8} {'vs direct':>9} {'reaction s':>10}",
    ]
    for f, rows in result["comparison"].items():
        for policy, r in rows.items():
            lines.append(
                f"{f:>4} {policy:<10} {_f(r['samples_per_s'], '.0f'):>9} "
                f"{_f(r['retained']):>8} {_f(r['achieved_slowdown']):>10}"
                f"{'*' if r['achieved_from'] not in ('off', 'own') else ' '}"
                f"{_f(r['vs_off']):>6} {_f(r['ideal']):>5} {_f(r['vs_ideal']):>8} "
                f"{_f(r['vs_ideal_direct']):>9} {_f(r['reaction_s'], '.1f'):>10}"
            )
    lines.append(
        "retained: vs the same run unthrottled right before and after; ideal: (R-1+1/f')/R; "
        "vs direct: vs the sum of the replicas' measured speeds (1 = perfect balancing on shared "
        "cores); f': the victim's compute per sample in the off run (* other runs')"
    )
    for policy, run in runs.items():
        if run.get("flaps"):
            lines += ["", *_render_flaps(policy, run, s)]
    for policy, why in result["skipped"].items():
        lines.append(f"skipped {policy}: {why}")
    return "\n".join(lines)


def _render_flaps(policy: str, run: Mapping[str, Any], s: Mapping[str, Any]) -> list[str]:
    decisions = run["status"]["decisions"]
    lines = [
        f"come-and-go under {policy}: {s['flap_factor']:g}x for {s['flap_s']:g} s, off "
        f"{s['flap_s']:g} s, x{s['flaps']}",
        f"{'segment':<8} {'f':>4} {'samples/s':>9} {'changes':>7} "
        f"{'decisions':>9} {'even after s':>12} {'changes once even':>17}",
    ]
    for seg in run["flaps"]:
        n_dec = decisions_in(decisions, seg["t0"], seg["t1"])
        lines.append(
            f"{seg['name']:<8} {seg['factor']:>4g} {_f(seg['samples_per_s'], '.0f'):>9} "
            f"{len(seg['changes']):>7} {n_dec:>9} "
            f"{_f(seg.get('even_after_s'), '.1f'):>12} "
            f"{'-' if seg.get('changes_once_even') is None else seg['changes_once_even']:>17}"
        )
    thrash, unsettled = flap_verdict(run["flaps"])
    lines.append(
        f"assignment changes in all: {sum(len(seg['changes']) for seg in run['flaps'])}; "
        f"planner decisions seen by `fthsdp status`: {len(decisions)}; thrashing: "
        f"{'YES' if thrash else 'no'}{'; NOT back to even at the end' if unsettled else ''}"
    )
    return lines


def _cycle_ms(backend: str, settings: Mapping[str, Any]) -> float:
    """The throttle's cycle: the CFS period of a cgroup backend, else `--period-ms`."""
    return CPU_PERIOD_US / 1e3 if backend.startswith("cgroup") else float(settings["period_ms"])


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(",") if v)
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("comma-separated factors >= 1")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.failslow", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica (default 2)")
    p.add_argument("--micro-steps", type=int, default=4, help="even share per replica (4)")
    p.add_argument("--slowdowns", type=_floats, default=SLOWDOWNS, help="factors (1.5,2,3)")
    p.add_argument(
        "--policies", help=f"runs, in order (default {','.join(POLICIES)}; --quick: off,auto)"
    )
    p.add_argument("--victim", help="the throttled replica (default the last)")
    p.add_argument(
        "--throttle", choices=("auto", "signals", "cgroup", "cgroup-v1"), default="auto",
        help="auto: a cgroup CPU quota (v2, else v1) where writable, else SIGSTOP/SIGCONT",
    )  # fmt: skip
    p.add_argument("--period-ms", type=float, default=60.0, help="signals: cycle (60)")
    p.add_argument("--windows", type=int, default=3, help="measured windows per segment (3)")
    p.add_argument("--window-s", type=float, default=4.0, help="seconds per window (4)")
    p.add_argument("--warmup-s", type=float, default=6.0, help="before measuring (6)")
    p.add_argument(
        "--settle-s", type=float, default=6.0,
        help="throttled, before measuring: detection and reaction (6)",
    )  # fmt: skip
    p.add_argument("--recover-s", type=float, default=8.0, help="unthrottled after each f (8)")
    p.add_argument("--flap-policy", default="auto", help="the policy that gets the flaps (auto)")
    p.add_argument("--flap-factor", type=float, default=2.0, help="flaps' slowdown (2)")
    p.add_argument("--flap-s", type=float, default=12.0, help="T: seconds on, then off (12)")
    p.add_argument("--flaps", type=int, default=2, help="on/off cycles (2; 0: none)")
    p.add_argument("--durable-every-steps", type=int, default=0, help="demo's (0: none)")
    p.add_argument("--seed", type=int, default=0, help="demo seed (0)")
    p.add_argument(
        "--quick", action="store_true",
        help="smoke run (~3 min): f=2, policies off and auto, 2 windows, short flaps",
    )  # fmt: skip
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--work-dir", type=Path, help="run directories go under it (default: temp)")
    args = p.parse_args(argv)
    if args.quick:
        args.slowdowns = (2.0,)
        args.policies = args.policies or "off,auto"
        args.windows, args.warmup_s, args.settle_s, args.recover_s = 2, 4.0, 5.0, 6.0
        args.flap_s = 6.0
    args.policies = [x for x in (args.policies or ",".join(POLICIES)).split(",") if x]
    if unknown := set(args.policies) - set(POLICIES):
        p.error(f"unknown policies {sorted(unknown)}; known: {POLICIES}")
    if args.replicas < 2 or args.ranks < 1 or args.micro_steps < 1 or args.windows < 1:
        p.error("--replicas >= 2; --ranks, --micro-steps, --windows >= 1")
    if min(args.window_s, args.period_ms, args.flap_factor - 1 + 1e-9) <= 0 or args.flaps < 0:
        p.error("--window-s, --period-ms positive; --flap-factor >= 1; --flaps >= 0")
    args.victim = args.victim or f"r{args.replicas - 1}"
    if args.victim not in {f"r{i}" for i in range(args.replicas)}:
        p.error(f"--victim must be one of r0..r{args.replicas - 1}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.micro, args.accepted = demo_flags()
    base = args.work_dir or Path(tempfile.mkdtemp(prefix="fthsdp-bench-failslow-"))
    root = base / datetime.now().strftime("failslow-%Y%m%d-%H%M%S")
    root.mkdir(parents=True)
    started = time.monotonic()
    from fthsdp.bench.recovery import machine

    mach = machine()
    if not args.micro:
        print("the demo has no --micro-steps yet: every replica trains one micro-step per step")
    runs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for policy in args.policies:
        if policy not in args.accepted:
            skipped[policy] = f"the demo does not accept --failslow-policy {policy} yet"
            print(f"skipping {policy}: {skipped[policy]}", flush=True)
            continue
        try:
            runs[policy] = run_policy(policy, args, root)
        except Exception as exc:  # one broken run must not hide the others' numbers
            skipped[policy] = f"failed: {type(exc).__name__}: {exc}"
            print(f"[{_stamp()}] {policy}: {skipped[policy]}", flush=True)
    mach["load_avg_end"] = _load()
    settings = {k: sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v
                for k, v in sorted(vars(args).items())}  # fmt: skip
    result: dict[str, Any] = {
        "benchmark": "failslow",
        "command": shlex.join(
            ["python", "-m", "bench.failslow", *(sys.argv[1:] if argv is None else argv)]
        ),
        "settings": settings,
        "machine": mach,
        "work_dir": str(root),
        "total_s": time.monotonic() - started,
        "throttle_backend": next((r["throttle"]["backend"] for r in runs.values()), args.throttle),
        "runs": runs,
        "skipped": skipped,
        "comparison": compare(runs, args.replicas),
    }
    text = json.dumps(result, indent=2, default=str)
    (root / "failslow.json").write_text(text)
    if args.json is not None:
        args.json.write_text(text)
    print()
    print(render(result))
    print(f"\ntotal {result['total_s']:.0f} s; JSON: {args.json or root / 'failslow.json'}")
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
