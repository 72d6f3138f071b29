"""The control plane at 100K GPUs, emulated on this machine: the real quorum service and the real
central health service, each in its own process, real gRPC with the bearer token, and emulated
leaders, ranks and node agents in a few client processes (bench.scale_emulated; no torch).

    python -m bench.scale --shape 12x8192 --lift-world-size-cap --json scale.json
    python -m bench.scale --shape 1536x64 --failures 2
    python -m bench.scale --shape 4x16                           # a small smoke run

Phases, each bounded by a deadline so the harness always finishes and says what did not:
0. one hop of the replica's notice relay, on the real code (bench.scale_relay).
1. setup: every leader joins with its ranks' endpoints (and beats from then on) and opens its
   Watch stream; its ranks hear events through the relay tree, a measured hop per level. Then
   every host's node agent opens its own Watch stream (`--agent-streams`: filtered to its
   replica, as `NodeAgent` does; `all`: every event of the job, as before; `off`).
2. rounds: the first round (every member, and the endpoints of each leader's ring neighbours),
   then `--rounds` steady rounds back to back:
   server-side p50/p99 (last ask -> every participant answered, measured by the service),
   client-side (last request sent -> last answer), the service's CPU seconds per round (from
   /proc), the bytes of the answers (QuorumResponse sizes as received).
3. per failure (`--failures`), a timestamp for each stage from the rank's death: its node agent
   (the real NodeAgent, its ranks real processes) sees the process exit (`--death crash`, a
   SIGKILL) or finds the rank silent (`--death hang`) and the service evicts the replica; every
   surviving rank hears of it (its leader's Watch stream, then the relay tree) and aborts its
   exchange; every surviving replica votes no; every surviving leader holds a quorum without
   it, then the quorum of all survivors; every surviving rank holds its new ring neighbours
   (checked against the expected ring); every node agent of the victim's replica hears it
   evicted on its own stream. A stage that does not complete within
   `--stage-timeout-s` is reported as "done / total after N s".
4. health ingest: every node agent forwards its node state every `HealthConfig.forward_interval`
   (200 ms), or at the longer interval central answers with when it has more agents than it
   takes forwards (`HealthConfig.ingest_forwards_per_s`); once every agent heard it, for
   `--ingest-s` or two such intervals: forwards/s needed at that interval vs acknowledged, and
   the central service's CPU per forward (its idle cost subtracted).
5. RCA: a hang at this size over the real wire (bench.scale_rca).
Each process's CPU seconds and peak RSS per phase come from /proc, the services' garbage
collection time from `gc.callbacks` in their processes. Prints a table (bench.scale_render) and
writes JSON. Not a pass/fail test.

Today's service refuses replicas of more than 4,096 ranks: `--lift-world-size-cap` raises that
cap inside the service process only, to measure the rest. `--quorum-heartbeat-timeout-ms`
changes the service's heartbeat timeout (1 s by default): when the service is busy for longer
than that, heartbeats wait and healthy replicas are evicted (it was, with one Watch stream per
rank); a long timeout shows what the other stages cost once that is out of the way."""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fthsdp.bench.scale_agent_streams import AGENT_STREAM_MODES
from fthsdp.bench.scale_agents import INGEST_SETTLE_S
from fthsdp.bench.scale_harness import Harness
from fthsdp.bench.scale_model import Shape, Victim, parse_shape, victims
from fthsdp.bench.scale_phases import failure_result, ingest_result, rounds_result, setup_result
from fthsdp.bench.scale_rca import run_rca
from fthsdp.bench.scale_relay import depth, measure_hop
from fthsdp.bench.scale_render import render
from fthsdp.services.common import logs
from fthsdp.services.health.config import MAX_FORWARD_INTERVAL, HealthConfig
from fthsdp.services.quorum import core as quorum_core

IDLE_S = 2.0
"""How long the central service is watched idle after the ingest (its evaluation timer's own
cost, subtracted from its CPU per forward)."""


def run(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    """Every phase against freshly started services; the result document."""
    started = time.monotonic()
    token = secrets.token_urlsafe(24)
    plan_victims = victims(shape, args.failures)
    result: dict[str, Any] = {
        "benchmark": "scale",
        "shape": {**asdict(shape), "total_ranks": shape.total_ranks, "hosts": shape.hosts},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "profile")},
        "machine": machine(),
        "incomplete": [],
    }
    if shape.ranks > quorum_core.MAX_WORLD_SIZE:
        result["world_size_cap"] = {
            "cap": quorum_core.MAX_WORLD_SIZE,
            "lifted_in_the_service_process": bool(args.lift_world_size_cap),
        }
    harness = Harness(args, shape, token)
    try:
        # Before any other process runs: the hop as a quiet host would see it.
        relay = measure_hop(members=min(shape.replicas, 1536))
        result["relay"] = {**relay, "depth": depth(shape.ranks - 1)}
        harness.start(plan_victims, relay_hop_s=relay["hop_s_p99"])
        _phases(harness, args, shape, plan_victims, result)
    except (EOFError, TimeoutError, OSError) as exc:  # a process died or hung: report, finish
        result["incomplete"].append(f"aborted during {harness.current}: {exc}")
    except Exception as exc:  # a bug here must not cost the run's figures so far
        traceback.print_exc()
        result["incomplete"].append(
            f"aborted during {harness.current}: {type(exc).__name__}: {exc} (a harness error)"
        )
    finally:
        result["clients"] = harness.stop()
        watchdog = harness.watchdog
        result["processes"] = {
            name: {
                "cpu_s": harness.cpu.get(name, {}),
                "gc_s": harness.gc.get(name, {}),
                "rss_peak_bytes": None if watchdog is None else watchdog.peaks.get(name),
            }
            for name in harness.procs
        }
        if watchdog is not None and watchdog.tripped:
            result["incomplete"].append(f"aborted: {watchdog.tripped}")
        result["incomplete"] += harness.notes
        result["machine"]["load_avg_end"] = _load()
        result["wall_s"] = time.monotonic() - started
    return result


def _progress(message: str) -> None:
    """A line on stderr as each phase ends (a full-size run takes minutes)."""
    print(f"[bench.scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _phases(
    harness: Harness,
    args: argparse.Namespace,
    shape: Shape,
    plan_victims: list[Victim],
    result: dict[str, Any],
) -> None:
    todo = result["incomplete"]
    limit = args.setup_timeout_s
    setup = setup_result(harness.phase("setup", "setup", limit, deadline_s=limit), shape, limit)
    setup["quorum_rss_bytes"] = _rss(harness, "quorum")
    result["setup"] = setup
    _progress(f"setup: {setup['joined']} leaders, {setup['streams_live']:,} streams live")
    todo += setup["incomplete"]
    if setup["joined"] == 0:
        todo.append("rounds and failures skipped: no leader could join")
    else:
        first = harness.phase("first_round", "rounds", args.stage_timeout_s, count=1,
                              deadline_s=args.stage_timeout_s, phase="first_round")  # fmt: skip
        since = max((r for r, _, _ in harness.ask("quorum", "timings", 0)), default=0)
        steady = harness.phase("rounds", "rounds", args.stage_timeout_s, count=args.rounds,
                               deadline_s=args.stage_timeout_s, phase="rounds")  # fmt: skip
        timings = harness.ask("quorum", "timings", since)
        cpu = harness.cpu.get("quorum", {}).get("rounds")
        result["rounds"] = rounds_result(first, steady, timings, cpu, args.rounds)
        _progress(f"rounds: {result['rounds']['rounds']} steady")
        todo += result["rounds"]["incomplete"]
        result["failures"] = []
        for number, victim in enumerate(plan_victims, start=1):
            failure = _failure(harness, args, shape, plan_victims, number, victim)
            _progress(f"failure {number}: " + "; ".join(
                f"{s['name']} {s['seconds']:.3f} s" if s["complete"] else f"{s['name']} --"
                for s in failure["stages"]
            ))  # fmt: skip
            result["failures"].append(failure)
            todo += failure["incomplete"]
    served = harness.ask("central", "reports", None)
    # Settling, then the window: the agents' own seconds, or two of the intervals central asks.
    longest = INGEST_SETTLE_S + max(args.ingest_s, 2 * MAX_FORWARD_INTERVAL.total_seconds())
    ingest = harness.phase("ingest", "ingest", longest, seconds=args.ingest_s)
    served = harness.ask("central", "reports", None) - served
    # Idle after the ingest: its evaluations now cover every rank the node states named.
    idle = _idle_share(harness, "central", IDLE_S)
    central_cpu = harness.cpu.get("central", {}).get("ingest")
    result["ingest"] = ingest_result(ingest, HealthConfig(), central_cpu, served, idle)
    _progress(f"ingest: {result['ingest']['acked']:,} forwards acknowledged")
    culprit = _culprit(shape, plan_victims)
    harness.current = "rca"
    before = harness.samples()
    result["rca"] = run_rca(
        shape, harness.central_address, harness.token,
        lambda since: harness.ask("central", "evaluations", since),
        lambda seconds: harness.ask("central", "hang_timeout", seconds), culprit,
        hang_timeout_s=args.hang_timeout_s, deadline_s=args.rca_timeout_s,
    )  # fmt: skip
    harness.account("rca", before)
    if not result["rca"]["named"]:
        todo.append(f"RCA: the hung rank was not named within {args.rca_timeout_s:g} s")


def _failure(
    harness: Harness,
    args: argparse.Namespace,
    shape: Shape,
    plan_victims: list[Victim],
    number: int,
    victim: Victim,
) -> dict[str, Any]:
    """Arms every survivor's exchange, kills the rank, follows the survivors."""
    name, limit = f"failure-{number}", args.stage_timeout_s
    harness.current = name
    gone = {v.replica for v in plan_victims[:number]}
    survivors = [r for r in range(shape.replicas) if r not in gone]
    before = harness.samples()
    since = max((r for r, _, _ in harness.ask("quorum", "timings", 0)), default=0)
    armed = harness.broadcast("arm", limit, victim=victim, number=number)
    death = harness.kill_rank(victim)
    answers = harness.broadcast(
        "follow", limit, victim=victim, death=death, deadline_s=limit, survivors=survivors,
        detail=args.detail,
    )  # fmt: skip
    end = death + limit
    while not harness.reports(victim) and time.monotonic() < end:
        time.sleep(0.01)  # the report's answer may trail the Watch events it caused
    harness.account(name, before)
    errors = [a for a in armed if isinstance(a, dict) and "error" in a]
    failure = failure_result(
        [*errors, *answers], victim, death, harness.reports(victim), survivors, shape, limit,
        agent_streams=args.agent_streams,
    )  # fmt: skip
    failure["cpu_s"] = {n: c.get(name) for n, c in harness.cpu.items()}
    failure["gc_s"] = {n: c.get(name) for n, c in harness.gc.items()}
    # The rounds the service formed meanwhile: (participants, last ask -> every answer sent).
    failure["service_rounds"] = [
        (participants, seconds)
        for _, participants, seconds in harness.ask("quorum", "timings", since)
    ]
    return failure


def _idle_share(harness: Harness, name: str, seconds: float) -> float | None:
    """The share of a core a process spends with no load on it (its own timers)."""
    before = harness.samples()[0].get(name)
    time.sleep(seconds)
    after = harness.samples()[0].get(name)
    return None if before is None or after is None else (after.cpu_s - before.cpu_s) / seconds


def _culprit(shape: Shape, plan_victims: Sequence[Victim]) -> Victim:
    taken = {v.replica for v in plan_victims}
    replica = next(r for r in range(shape.replicas) if r not in taken)
    return Victim(replica=replica, rank=shape.ranks // 3)


def _rss(harness: Harness, name: str) -> int | None:
    s = harness.samples()[0].get(name)
    return None if s is None else s.rss_bytes


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """Where the numbers come from (no torch import: bench.recovery's needs it)."""
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_start": _load(),
    }


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Shape]:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--shape", required=True, help="REPLICASxRANKS, e.g. 12x8192 or 1536x64")
    p.add_argument("--hosts-per", type=int, default=8, help="ranks per host (default 8)")
    p.add_argument("--failures", type=int, default=1, help="ranks killed, one per replica (1)")
    p.add_argument(
        "--death", choices=("crash", "hang"), default="crash",
        help="crash: the rank's process is SIGKILLed, its agent sees it exit (default); hang: "
        "it only stops beating, and the agent's heartbeat timeout runs in full",
    )  # fmt: skip
    p.add_argument(
        "--agent-streams", choices=AGENT_STREAM_MODES, default="filtered",
        help="each node agent's quorum event stream: filtered to its host's replica, as agents "
        "open it (default); all: every event of the job, as before; off: none",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=10, help="steady quorum rounds (default 10)")
    p.add_argument("--clients", type=int, default=2, help="client processes (default 2)")
    p.add_argument("--json", type=Path, help="write the result document here")
    p.add_argument("--setup-timeout-s", type=float, default=240.0, help="joins + streams (240)")
    p.add_argument("--stage-timeout-s", type=float, default=60.0, help="per phase/failure (60)")
    p.add_argument("--ingest-s", type=float, default=5.0, help="health ingest window (5)")
    p.add_argument("--rca-timeout-s", type=float, default=120.0, help="RCA wait (120)")
    p.add_argument("--hang-timeout-s", type=float, default=3.0, help="central hang timeout (3)")
    p.add_argument(
        "--quorum-heartbeat-timeout-ms", type=int, default=1000,
        help="the quorum service's heartbeat timeout (its default: 1000)",
    )  # fmt: skip
    p.add_argument(
        "--lift-world-size-cap", action="store_true",
        help=f"raise the service's world-size cap ({quorum_core.MAX_WORLD_SIZE}) to the shape's "
        "ranks, in the service process only (today's service refuses larger replicas)",
    )  # fmt: skip
    p.add_argument("--max-rss-gb", type=float, default=16.0, help="abort past this RSS (16)")
    p.add_argument("--profile", help="cProfile the services into this directory")
    p.add_argument("--detail", action="store_true", help="every rank's neighbours in the JSON")
    args = p.parse_args(argv)
    try:
        shape = parse_shape(args.shape, args.hosts_per)
        victims(shape, args.failures)
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 1 or args.clients < 1:
        p.error("--rounds and --clients must be >= 1")
    for name in (
        "setup_timeout_s",
        "stage_timeout_s",
        "ingest_s",
        "rca_timeout_s",
        "hang_timeout_s",
        "max_rss_gb",
    ):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args, shape


def main(argv: Sequence[str] | None = None) -> int:
    args, shape = parse_args(argv)
    logs.configure("ERROR")  # the victims' agents log their incidents: they are the point here
    result = run(args, shape)
    print(render(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
