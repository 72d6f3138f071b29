"""The `fthsdp` command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from fthsdp.deploy import simulate_cli, status_cmd
from fthsdp.deploy.demo.mixes import SEQ_LEN_MIXES
from fthsdp.deploy.demo.supervisor import KILL_MODES, RESTART_POLICIES
from fthsdp.deploy.netns_demo import HOSTS
from fthsdp.deploy.up_cli import add_up_parser, run_up_command
from fthsdp.services.common.cli import add_logging_flags, setup_logging
from fthsdp.services.health.config import FAILURE_ACTIONS
from fthsdp.services.quorum.domain import FAILSLOW_POLICIES


def _positive_seconds(text: str) -> timedelta:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return timedelta(seconds=value)


def _demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole stack and a tiny GPT through injected failures",
        description=(
            "Starts the quorum service, a checkpoint sidecar and R replicas x W ranks training a "
            "small GPT on CPU; kills replicas on a schedule; restarts them; writes a JSON report "
            "and a PNG plot."
        ),
    )
    p.add_argument("--replicas", type=int, default=3, help="replicas in the job (default 3)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per replica (default 2)")
    p.add_argument(
        "--duration", type=_positive_seconds, default=timedelta(seconds=120),
        help="seconds of training, from when every replica is healthy (default 120)",
    )  # fmt: skip
    p.add_argument(
        "--kill-every", type=_positive_seconds, default=timedelta(seconds=25),
        help="seconds between injected failures (default 25)",
    )  # fmt: skip
    p.add_argument("--no-kills", action="store_true", help="inject no failures")
    p.add_argument(
        "--kill-mode", choices=KILL_MODES, default="process",
        help="process: SIGKILL one rank; replica: SIGKILL a whole replica; hang: SIGSTOP one "
        "rank; slow: throttle a whole replica for 12 s (SIGSTOP/SIGCONT 60%% of every 50 ms); "
        "quorum: restart the quorum service, or SIGKILL its leader with --redis; store: "
        "SIGKILL the redis-server (with --redis) for --store-down seconds; store-replica: "
        "that, and a whole replica 2 s later; with --hosts netns, for --fault-for seconds: "
        "blackhole: drop every packet of a replica's host; leader-blackhole: of the quorum "
        "leader's host (with --redis); leader-redis-cut: cut the leader from Redis only (with "
        "--redis); health-cut: cut a replica's host from health central; flap: a replica's "
        "link down and up every 3 s; slow-link: a replica's link limited to 40 Mbit/s "
        "(default process)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seeds failures and model init (default 0)")
    p.add_argument(
        "--run-dir", type=Path, default=Path("runs/demo"),
        help="directory for logs, checkpoints, report and plot (default runs/demo)",
    )  # fmt: skip
    p.add_argument(
        "--report", type=Path, help="also copy the JSON report here (default RUN_DIR/report.json)"
    )
    p.add_argument(
        "--plot", type=Path, help="also copy the PNG plot here (default RUN_DIR/report.png)"
    )
    p.add_argument("--micro-batch", type=int, default=4, help="samples per rank per micro-step")
    p.add_argument(
        "--micro-steps", type=int, default=1,
        help="each replica's even share of micro-steps (gradient accumulation) per step; "
        "--failslow-policy rebalance moves some from a slow replica to the fast ones (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--failslow-policy", choices=FAILSLOW_POLICIES, default="off",
        help="fail-slow mitigation by the quorum service: off, rebalance (needs --micro-steps "
        "> 1), evict (the slowest replica, when that pays) or auto (default off)",
    )  # fmt: skip
    p.add_argument(
        "--durable-every-steps", type=int, default=25,
        help="durable checkpoint period in steps, 0 disables (default 25)",
    )  # fmt: skip
    p.add_argument(
        "--heartbeat-timeout-ms", type=int, default=1000,
        help="the quorum service evicts a silent replica after this (default 1000)",
    )  # fmt: skip
    p.add_argument(
        "--join-timeout-ms", type=int, default=2000,
        help="longest a quorum waits for a live replica that has not asked (default 2000)",
    )  # fmt: skip
    p.add_argument(
        "--no-live", action="store_true",
        help="no live view: a progress line per replica (step, loss, state, restarts) every "
        "--progress-every seconds",
    )  # fmt: skip
    p.add_argument(
        "--progress-every", type=_positive_seconds, default=timedelta(seconds=10),
        help="--no-live: seconds between progress lines (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--fsdp", action="store_true",
        help="shard each replica over its ranks with FSDP2 (HSDP) instead of replicating it",
    )  # fmt: skip
    p.add_argument(
        "--overlap-backward", action="store_true",
        help="exchange gradient buckets across replicas while backward still runs (not with "
        "--fsdp)",
    )  # fmt: skip
    p.add_argument(
        "--loader-workers", type=int, default=0,
        help="DataLoader worker processes per rank (default 0: load in the rank itself)",
    )  # fmt: skip
    p.add_argument(
        "--state-pad-mb", type=int, default=0,
        help="MiB of constant bytes each rank adds to its replicated state, so snapshots and "
        "catch-up fetches move as much as a larger model's would (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--seq-len-mix", choices=SEQ_LEN_MIXES, default="uniform",
        help="document lengths: uniform (one 64-token window per sample, default); phases "
        "(512-token samples packed from short, then long documents, alternating every 20 "
        "micro-steps); random (packed from 8-512-token documents)",
    )  # fmt: skip
    p.add_argument(
        "--restart-policy", choices=RESTART_POLICIES, default="replica",
        help="replica: only the failed replica restarts (default); job: every replica restarts "
        "from the last durable checkpoint (the synchronous baseline)",
    )  # fmt: skip
    p.add_argument(
        "--min-replicas", type=int,
        help="smallest quorum (default: half of --replicas, rounded up, so a minority never "
        "trains; failures are injected only while more replicas than this are healthy)",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-dir", type=Path,
        help="durable checkpoints (default RUN_DIR/checkpoints); reuse one to resume a job",
    )  # fmt: skip
    p.add_argument(
        "--redis", action="store_true",
        help="run the quorum service as a leader and a standby on a local redis-server; "
        "--kill-mode quorum then SIGKILLs the leader (the standby takes over)",
    )  # fmt: skip
    p.add_argument(
        "--no-health", action="store_true",
        help="do not run the health service (detectors, dashboard) nor send it telemetry",
    )  # fmt: skip
    p.add_argument(
        "--faults", default="",
        help="planned rank faults replica:rank:step:point[,...], point in "
        "exchange|fetch|serve|commit (the rank dies), hang (it stops making progress) or "
        "slow[:seconds] (it is 80 ms late to every exchange, for 10 s by default); "
        "each fires once",
    )  # fmt: skip
    p.add_argument(
        "--on-failure", choices=FAILURE_ACTIONS, default="kill",
        help="kill: a dead or hung rank's replica is torn down (its agent kills its processes, "
        "its ranks exit) and restarted (default); report: it is only evicted",
    )  # fmt: skip
    p.add_argument(
        "--hang-timeout", type=_positive_seconds, default=timedelta(seconds=3),
        help="seconds a collective may stay open before the health service calls it a hang "
        "(default 3)",
    )  # fmt: skip
    p.add_argument(
        "--spares", type=int, default=0,
        help="warm spare rank processes (torch imported, model built) that a restarted replica "
        "takes over instead of starting fresh ones (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--store-down", type=_positive_seconds, default=timedelta(seconds=10),
        help="--kill-mode store: seconds the killed redis-server stays down before it is "
        "restarted (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--hosts", choices=HOSTS, default="loopback",
        help="loopback: every service and replica on this machine's loopback (default); netns: "
        "the control plane, health central and each replica in a network namespace of its own, "
        "with its own address (root only; removed at the end)",
    )  # fmt: skip
    p.add_argument(
        "--fault-for", type=_positive_seconds, default=timedelta(seconds=5),
        help="--hosts netns: seconds a network fault lasts before it is healed (default 5)",
    )  # fmt: skip
    # The launcher's own logging; the demo passes both on to every process it starts.
    add_logging_flags(p, level_default="WARNING")


def _run_demo(args: argparse.Namespace) -> int:
    from fthsdp.deploy.demo.run import DemoConfig, run_demo

    config = DemoConfig(
        replicas=args.replicas,
        ranks=args.ranks,
        duration=args.duration,
        kill_every=None if args.no_kills else args.kill_every,
        kill_mode=args.kill_mode,
        seed=args.seed,
        run_dir=args.run_dir,
        micro_batch=args.micro_batch,
        micro_steps=args.micro_steps,
        failslow_policy=args.failslow_policy,
        durable_every_steps=args.durable_every_steps,
        heartbeat_timeout=timedelta(milliseconds=args.heartbeat_timeout_ms),
        join_timeout=timedelta(milliseconds=args.join_timeout_ms),
        live=not args.no_live,
        progress_every=args.progress_every,
        # Without the flag the processes read the FTHSDP_LOG_FORMAT they inherit, as this one did.
        log_format=args.log_format,
        log_level=args.log_level,
        checkpoint_dir=args.checkpoint_dir,
        faults=args.faults,
        min_replicas=args.min_replicas,
        restart_policy=args.restart_policy,
        fsdp=args.fsdp,
        overlap_backward=args.overlap_backward,
        loader_workers=args.loader_workers,
        state_pad_mb=args.state_pad_mb,
        seq_len_mix=args.seq_len_mix,
        redis=args.redis,
        health=not args.no_health,
        on_failure=args.on_failure,
        hang_timeout=args.hang_timeout,
        store_down=args.store_down,
        spares=args.spares,
        hosts=args.hosts,
        fault_for=args.fault_for,
    )
    report = run_demo(config)
    if args.report:
        args.report.write_text(json.dumps(report, indent=2))
    if args.plot:
        args.plot.write_bytes((args.run_dir / "report.png").read_bytes())
    invariants = report.get("invariants", {})
    print(json.dumps({"invariants": invariants, "summary": report.get("summary", {})}, indent=2))
    print(f"report: {args.report or args.run_dir / 'report.json'}")
    print(f"plot:   {args.plot or args.run_dir / 'report.png'}")
    return 0 if all(v.get("ok") for v in invariants.values()) else 1


def _version() -> str:
    """The installed distribution's version ("unknown" when run from a tree never installed)."""
    try:
        return importlib.metadata.version("fthsdp")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    # gRPC's informational lines (fork notices whenever the launcher starts a process) would
    # drown the demo's output; an explicit GRPC_VERBOSITY still wins.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = argparse.ArgumentParser(prog="fthsdp", description="fault-tolerant HSDP training")
    parser.add_argument("--version", action="version", version=f"fthsdp {_version()}")
    sub = parser.add_subparsers(dest="command")
    _demo_parser(sub)
    add_up_parser(sub)
    status_cmd.add_parser(sub)
    simulate_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command is None:  # a first look: what there is to run
        parser.print_help()
        return 0
    try:
        setup_logging(args, os.environ, level_default="WARNING")
        if args.command == "up":
            return run_up_command(args)
        if args.command == "status":
            return status_cmd.run(args, sys.stdout)
        if args.command == "simulate":
            return simulate_cli.run(args, sys.stdout)
        return _run_demo(args)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
