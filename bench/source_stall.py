"""What a recovering replica's catch-up costs the healthy replicas that serve it, on the real path.

    python -m bench.source_stall --state-pad-mb 1024 --replicas 3 --ranks 1 \
        --duration-s 60 --kill-every-s 15 --json bench-source-stall.json

Runs the demo job twice with the same failure schedule (whole replicas SIGKILLed, restarted, and
caught up from their peers): once with `--state-pad-mb N` (N MiB more state per rank, so every
snapshot and catch-up fetch moves that much) and once with the demo's own few hundred kilobytes.
From the replicas' commit records (`deploy.demo.events`) it reads, per catch-up (a replica's
step committed as `recovered`; a rejoin is the catch-up after which the replica stayed):

- `publish_s`: each source's time publishing its snapshot in that step (the step's `serve`
  phase), on its training thread before it enters the exchange;
- `next_quorum_s`: each source's wait for the next step's quorum, where the round waits (up to
  the join timeout) for the recovering replica still fetching and loading;
- `lost_s`: the time the catch-up cost each source, from the serve step to the one after the next
  quorum: the sum of their commit intervals above the source's median interval;
- `fetch_s` / `load_s`: the recovering replica's wait for the rest of the fetch after its own
  exchange, and its load of the fetched state;
- `catch_ups`: how many times the replica's process has caught up so far (more than one when a
  catch-up outlasted the join timeout: the round went on without it and it fell behind again;
  the quorum service then waits for its next catch-up up to `--catchup-timeout-ms`);
- `while_serving`: the source's steps committed after the next quorum's and before the end of
  the recovering replica's fetch, and their median interval against the source's median: the
  training step while its sidecar sends (none when the sources wait for the catch-up instead).

Prints a table and writes JSON (every catch-up, the command line, the machine and its load). Not a
pass/fail test: on a small shared machine the seconds move with the load, so the two runs are
side by side in one invocation."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from fthsdp.bench.recovery import machine
from fthsdp.deploy.demo.events import CommitEvent, RunLog, StartEvent
from fthsdp.deploy.demo.mixes import MAX_STATE_PAD_MB
from fthsdp.deploy.demo.run import DemoConfig, run_demo

log = logging.getLogger("fthsdp.bench.source_stall")


@dataclass(frozen=True, kw_only=True, slots=True)
class CatchUp:
    """One recovering replica's catch-up and what it cost its sources."""

    replica: str
    step: int
    stayed: bool
    """The replica went on training after it (a rejoin), not behind again."""
    catch_ups: int
    fetch_s: float
    load_s: float
    sources: tuple[str, ...]
    publish_s: tuple[float, ...]
    next_quorum_s: tuple[float, ...]
    lost_s: tuple[float, ...]
    while_serving_steps: int
    while_serving_ratio: float | None
    """Median interval of the sources' steps committed while serving over their median interval;
    None when no source trained a step meanwhile."""


def _commits(log_: RunLog) -> dict[str, list[CommitEvent]]:
    return {
        replica: [e for e in events if isinstance(e, CommitEvent)]
        for replica, events in log_.replicas.items()
    }


def _catch_ups(events: Sequence[object], step: int) -> int:
    """Recovered commits of this replica's process (since its last start) up to `step`."""
    count = 0
    for event in events:
        if isinstance(event, StartEvent):
            count = 0
        elif isinstance(event, CommitEvent) and event.recovered:
            count += 1
            if event.step == step:
                return count
    return count


def _median_interval(commits: Sequence[CommitEvent]) -> float:
    gaps = [b.t - a.t for a, b in itertools.pairwise(commits) if b.step == a.step + 1]
    return statistics.median(gaps) if gaps else 0.0


def catch_ups(log_: RunLog) -> list[CatchUp]:
    """Every catch-up of the run, with its sources' costs."""
    commits = _commits(log_)
    medians = {r: _median_interval(c) for r, c in commits.items()}
    position = {r: {e.step: i for i, e in enumerate(own)} for r, own in commits.items()}
    out: list[CatchUp] = []
    for replica, own in commits.items():
        for index, event in enumerate(own):
            if not event.recovered:
                continue
            stayed = index + 1 < len(own) and not own[index + 1].recovered
            fetch_end = event.t - event.seconds.get("commit", 0.0)
            sources, publish, quorum, lost = [], [], [], []
            serving: list[float] = []
            for source, theirs in commits.items():
                at = position[source].get(event.step)
                if source == replica or at is None or theirs[at].quorum_id != event.quorum_id:
                    continue
                if theirs[at].seconds.get("serve", 0.0) <= 0.0:
                    continue  # healthy in that step but not asked to serve
                sources.append(source)
                publish.append(theirs[at].seconds["serve"])
                after = theirs[at + 1] if at + 1 < len(theirs) else None
                quorum.append(after.seconds.get("quorum", 0.0) if after is not None else 0.0)
                window = theirs[max(at - 1, 0) : at + 3]
                lost.append(
                    sum(
                        max(0.0, (b.t - a.t) - medians[source])
                        for a, b in itertools.pairwise(window)
                    )
                )
                # From the step after the next quorum's: that one's interval is the wait.
                serving += [
                    (theirs[i].t - theirs[i - 1].t) / medians[source]
                    for i in range(at + 2, len(theirs))
                    if theirs[i].t <= fetch_end and medians[source] > 0
                ]
            out.append(
                CatchUp(
                    replica=replica,
                    step=event.step,
                    stayed=stayed,
                    catch_ups=_catch_ups(log_.replicas[replica], event.step),
                    fetch_s=event.seconds.get("fetch", 0.0),
                    load_s=event.seconds.get("commit", 0.0),
                    sources=tuple(sources),
                    publish_s=tuple(publish),
                    next_quorum_s=tuple(quorum),
                    lost_s=tuple(lost),
                    while_serving_steps=len(serving),
                    while_serving_ratio=statistics.median(serving) if serving else None,
                )
            )
    return sorted(out, key=lambda r: r.step)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(found: Sequence[CatchUp], step_s: float) -> dict[str, Any]:
    """Medians over the catch-ups (each one's sources pooled)."""

    def pooled(field: str) -> list[float]:
        return [v for r in found for v in getattr(r, field)]

    ratios = [r.while_serving_ratio for r in found if r.while_serving_ratio is not None]
    return {
        "rejoins": sum(r.stayed for r in found),
        "catch_ups": len(found),
        "median_step_s": step_s,
        "catch_ups_max": max((r.catch_ups for r in found), default=0),
        "publish_s": _median(pooled("publish_s")),
        "next_quorum_s": _median(pooled("next_quorum_s")),
        "lost_s": _median(pooled("lost_s")),
        "lost_s_max": max(pooled("lost_s"), default=None),
        "fetch_s": _median([r.fetch_s for r in found]),
        "load_s": _median([r.load_s for r in found]),
        "while_serving_steps": sum(r.while_serving_steps for r in found),
        "while_serving_ratio": _median(ratios),
    }


def _run(args: argparse.Namespace, pad_mb: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"pad{pad_mb}"
    config = DemoConfig(
        replicas=args.replicas,
        ranks=args.ranks,
        duration=timedelta(seconds=args.duration_s),
        kill_every=timedelta(seconds=args.kill_every_s),
        kill_mode="replica",
        seed=args.seed,
        run_dir=run_dir,
        durable_every_steps=0,  # only catch-up publishes: each serve step is a catch-up's
        join_timeout=timedelta(milliseconds=args.join_timeout_ms),
        state_pad_mb=pad_mb,
        live=False,
        progress_every=timedelta(seconds=30),
    )
    t0 = time.monotonic()
    report = run_demo(config)
    log_ = RunLog.load(run_dir)
    found = catch_ups(log_)
    steps = [_median_interval(c) for c in _commits(log_).values()]
    return {
        "state_pad_mb": pad_mb,
        "wall_s": time.monotonic() - t0,
        "invariants_ok": all(v.get("ok") for v in report.get("invariants", {}).values()),
        "summary": summarise(found, statistics.median(steps) if steps else 0.0),
        "catch_ups": [asdict(r) for r in found],
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (
            "rejoins / catch-ups (most by one process)",
            f"{s['rejoins']} / {s['catch_ups']} ({s['catch_ups_max']})",
        ),
        ("median step s", _fmt(s["median_step_s"], 3)),
        ("source publish s (serve step)", _fmt(s["publish_s"])),
        ("source wait at the next quorum s", _fmt(s["next_quorum_s"])),
        ("source time lost per catch-up s (max)", f"{_fmt(s['lost_s'])} ({_fmt(s['lost_s_max'])})"),
        ("recovering: fetch after its exchange s", _fmt(s["fetch_s"])),
        ("recovering: load s", _fmt(s["load_s"])),
        ("source steps trained while serving", str(s["while_serving_steps"])),
        ("  their interval / the source's median", _fmt(s["while_serving_ratio"])),
    ]


def render(result: dict[str, Any]) -> str:
    runs = result["runs"]
    head = ["", *(f"state +{r['state_pad_mb']} MiB/rank" for r in runs)]
    columns = [_rows(r["summary"]) for r in runs]
    table = [head] + [
        [name, *(column[i][1] for column in columns)] for i, (name, _) in enumerate(columns[0])
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    ok = ", ".join(
        f"+{r['state_pad_mb']}: {'ok' if r['invariants_ok'] else 'FAILED'}" for r in runs
    )
    return "\n".join([*lines, f"invariants (I1, I2, I6): {ok}"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--state-pad-mb", type=int, default=1024,
        help="MiB of extra state per rank in the measured run (default 1024); a second run "
        "without any is the reference",
    )  # fmt: skip
    p.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per replica (default 1)")
    p.add_argument("--duration-s", type=float, default=60.0, help="training seconds per run")
    p.add_argument("--kill-every-s", type=float, default=15.0, help="seconds between kills")
    p.add_argument(
        "--join-timeout-ms", type=int, default=2000,
        help="the quorum's wait for a live replica that has not asked (default 2000, the demo's)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="failure schedule and model seed")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--work-dir", type=Path, help="run directories go here (default: a temp dir)")
    args = p.parse_args(argv)
    if not 1 <= args.state_pad_mb <= MAX_STATE_PAD_MB:
        p.error(f"--state-pad-mb must be in 1..{MAX_STATE_PAD_MB}")
    if args.replicas < 2 or args.ranks < 1:
        p.error("--replicas must be >= 2 (one must survive a kill) and --ranks >= 1")
    if args.duration_s <= 0 or args.kill_every_s <= 0 or args.join_timeout_ms <= 0:
        p.error("--duration-s, --kill-every-s and --join-timeout-ms must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fthsdp-source-stall-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": shlex.join([sys.executable, "-m", "bench.source_stall", *sys.argv[1:]]),
        "machine": machine(),
        "settings": vars(args) | {"json": str(args.json), "work_dir": str(work)},
        "runs": [_run(args, pad, work) for pad in (args.state_pad_mb, 0)],
    }
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"json: {args.json}")
    return 0 if all(r["invariants_ok"] for r in result["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
