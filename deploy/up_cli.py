"""`fthsdp up`'s command line: its flags (each documented in `--help` and the README) and the
`UpConfig` they make (`deploy/up.py` runs it)."""

from __future__ import annotations

import argparse
from datetime import timedelta
from pathlib import Path

from fthsdp.deploy.job import JobConfig
from fthsdp.deploy.up import run_up
from fthsdp.deploy.up_plan import UpConfig
from fthsdp.services.common import logs
from fthsdp.services.quorum.domain import FAILSLOW_POLICIES


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be in 0..65535 (0 = a free port)")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers `fthsdp up`."""
    p = sub.add_parser(
        "up",
        help="run the control plane alone (quorum, checkpoint, health) as local processes",
        description=(
            "Starts the fthsdp services as supervised local processes, waits until they are "
            "ready, prints their addresses and writes an env file (FTHSDP_QUORUM, "
            "FTHSDP_CHECKPOINT_URL, FTHSDP_SHM_DIR, FTHSDP_HEALTH, FTHSDP_TOKEN_FILE) to start "
            "replicas against. A service that dies is restarted on the same ports. Ctrl-C or "
            "SIGTERM stops everything (a second Ctrl-C kills at once)."
        ),
    )
    p.add_argument(
        "--run-dir", type=Path, default=Path("runs/up"),
        help="logs, token, env file, services.json, checkpoints (default runs/up)",
    )  # fmt: skip
    p.add_argument(
        "--host", default="127.0.0.1",
        help="interface every service binds (default 127.0.0.1; 0.0.0.0 for other hosts)",
    )  # fmt: skip
    p.add_argument(
        "--advertise-host",
        help="host written into the env file (default --host, or this machine's name when "
        "--host is a wildcard)",
    )
    p.add_argument(
        "--token-file", type=Path,
        help="bearer token file (default RUN_DIR/token, generated with mode 0600 if missing)",
    )  # fmt: skip
    for flag, text in (
        ("--quorum-port", "gRPC port of the quorum service (the leader with --redis)"),
        ("--quorum-admin-port", "its /livez /readyz /metrics HTTP port"),
        ("--standby-port", "gRPC port of the standby quorum instance (with --redis)"),
        ("--standby-admin-port", "its /livez /readyz /metrics HTTP port (with --redis)"),
        ("--checkpoint-port", "HTTP port of the checkpoint service"),
        ("--health-port", "gRPC port of the health service"),
        ("--health-http-port", "HTTP port of the health service (probes, dashboard)"),
    ):
        p.add_argument(flag, type=_port, default=0, help=f"{text} (default 0: a free port)")
    p.add_argument(
        "--redis", action="store_true",
        help="start a local redis-server (unix socket in RUN_DIR/redis, no TCP) and run the "
        "quorum service as leader + standby on it; checkpoint and health use it too",
    )  # fmt: skip
    p.add_argument(
        "--redis-url",
        help="use this existing Redis instead (redis://, rediss:// or unix://): leader + "
        "standby as with --redis",
    )
    p.add_argument(
        "--redis-server", default="redis-server",
        help="redis-server executable for --redis (default: redis-server on PATH)",
    )  # fmt: skip
    p.add_argument(
        "--lease-ttl-ms", type=int,
        help="leader lease lifetime of the quorum instances, ms (default: the service's)",
    )  # fmt: skip
    p.add_argument("--min-replicas", type=int, help="smallest quorum (default: the service's)")
    p.add_argument(
        "--failslow-policy", choices=FAILSLOW_POLICIES,
        help="fail-slow mitigation of the quorum service: move micro-steps from slow replicas "
        "to fast ones (rebalance), evict the slowest, or choose (auto); ranks need "
        "FTHSDP_MICRO_STEPS > 1 to rebalance (default off)",
    )  # fmt: skip
    p.add_argument(
        "--heartbeat-timeout-ms", type=int,
        help="the quorum service evicts a replica silent this long, ms (default: the service's)",
    )  # fmt: skip
    p.add_argument(
        "--join-timeout-ms", type=int,
        help="longest a quorum waits for a live replica that has not asked, ms (default: the "
        "service's)",
    )  # fmt: skip
    p.add_argument(
        "--catchup-timeout-ms", type=int,
        help="longest a quorum waits for a replica catching up again after its last catch-up "
        "outlasted the join timeout, ms (default: the service's, 60000)",
    )  # fmt: skip
    p.add_argument(
        "--shm-dir", type=Path,
        help="where ranks on this host publish snapshots (default: a fresh /dev/shm directory, "
        "removed on stop)",
    )  # fmt: skip
    p.add_argument(
        "--durable-dir", type=Path,
        help="durable checkpoints and data positions (default RUN_DIR/checkpoints)",
    )  # fmt: skip
    p.add_argument(
        "--env-file", type=Path, help="where to write the env file (default RUN_DIR/fthsdp.env)"
    )
    p.add_argument(
        "--ready-timeout-s", type=_positive, default=60.0,
        help="seconds the stack may take to become ready (default 60)",
    )  # fmt: skip
    p.add_argument(
        "--stop-grace-s", type=_positive, default=15.0,
        help="seconds each service may take to drain on stop before SIGKILL (default 15)",
    )  # fmt: skip
    p.add_argument(
        "--max-restarts", type=int, default=10,
        help="failures in a row after which a crash-looping service stops the stack; 0 never "
        "restarts (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--no-health", action="store_true",
        help="do not run the health service (ranks then send no telemetry)",
    )  # fmt: skip
    p.add_argument(
        "--replicas", type=int,
        help="also run the job: this many replicas of the command after -- (each --ranks "
        "processes given torchrun's variables and the env file's); a failed replica restarts, "
        "and the stack stops once every replica finished",
    )  # fmt: skip
    p.add_argument("--ranks", type=int, default=1, help="rank processes per replica (default 1)")
    p.add_argument(
        "--spares", type=int, default=0,
        help="warm spare processes of the command (it calls fthsdp.take_identity() after "
        "building its model): a failed replica's ranks are taken over at once (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--restart-delay-s", type=float, default=1.0,
        help="wait before a failed replica starts fresh processes (default 1; spares: none)",
    )  # fmt: skip
    p.add_argument(
        "--await-replicas-s", type=float, default=30.0,
        help="at the job's first launch, each replica's leader waits up to this long for every "
        "replica to register before its first step, so the job starts together (0: no wait; "
        "restarts never wait; default 30)",
    )  # fmt: skip
    p.add_argument(
        "job_command", nargs=argparse.REMAINDER, metavar="-- CMD",
        help="the rank's command (with --replicas)",
    )  # fmt: skip
    p.add_argument("--log-level", help="passed to every service (e.g. INFO, DEBUG)")
    p.add_argument(
        "--log-format", choices=logs.FORMATS,
        help="passed to every service, and used by this launcher: text or json (default text) "
        "[env FTHSDP_LOG_FORMAT]",
    )  # fmt: skip


def run_up_command(args: argparse.Namespace) -> int:
    """`fthsdp up` from parsed arguments (ValueError for a bad combination)."""
    config = UpConfig(
        run_dir=args.run_dir,
        host=args.host,
        advertise_host=args.advertise_host,
        token_file=args.token_file,
        quorum_port=args.quorum_port,
        quorum_admin_port=args.quorum_admin_port,
        standby_port=args.standby_port,
        standby_admin_port=args.standby_admin_port,
        checkpoint_port=args.checkpoint_port,
        health_port=args.health_port,
        health_http_port=args.health_http_port,
        redis=args.redis,
        redis_url=args.redis_url,
        redis_server=args.redis_server,
        health=not args.no_health,
        lease_ttl_ms=args.lease_ttl_ms,
        min_replicas=args.min_replicas,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        join_timeout_ms=args.join_timeout_ms,
        catchup_timeout_ms=args.catchup_timeout_ms,
        failslow_policy=args.failslow_policy,
        shm_dir=args.shm_dir,
        durable_dir=args.durable_dir,
        env_file=args.env_file,
        ready_timeout=timedelta(seconds=args.ready_timeout_s),
        stop_grace=timedelta(seconds=args.stop_grace_s),
        max_restarts=args.max_restarts,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    try:
        return run_up(config, job=job_of(args))
    except OSError as exc:
        raise ValueError(str(exc)) from exc


def job_of(args: argparse.Namespace) -> JobConfig | None:
    """The job to run beside the stack, if any (ValueError for a half-given one)."""
    command = list(args.job_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.replicas is None:
        if command or args.spares or args.ranks != 1:
            raise ValueError("a command, --ranks and --spares need --replicas")
        return None
    return JobConfig(
        command=tuple(command),
        replicas=args.replicas,
        ranks=args.ranks,
        spares=args.spares,
        restart_delay_s=args.restart_delay_s,
        max_failures_in_a_row=args.max_restarts,
        await_replicas_s=args.await_replicas_s,
    )
