"""`python -m fthsdp.services.health` / `fthsdp-health`: the central health service or a node agent.

Flags carry units; each falls back to an `FTHSDP_HEALTH_*` environment variable, then to the
default (flag > env > default). This is the only module that reads the environment. SIGTERM or
SIGINT drains gracefully; a second SIGINT exits at once. One banner line starting
`fthsdp-health listening on ` names the gRPC address and the HTTP URL."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fthsdp.services.common.cli import (
    Flag,
    add_flags,
    config_values,
    env_name,
    flag_or_env,
    setup_logging,
)
from fthsdp.services.common.signals import serve_until_signalled
from fthsdp.services.common.tokens import Token, load_token
from fthsdp.services.health.config import DEFAULT_PORTS, MODES, HealthConfig, Mode
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.process import HealthProcess
from fthsdp.services.health.server import SERVICE_NAME

log = logging.getLogger("fthsdp.services.health")

ENV_PREFIX = "FTHSDP_HEALTH_"


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


_FLAGS: tuple[Flag, ...] = (
    ("host", "host", str, "interface to bind (default 127.0.0.1)"),
    ("port", "port", int, "gRPC ingest port, 0 = any free port (central 7460, agent 7462)"),
    ("http-port", "http_port", int, "HTTP port, 0 = any, -1 = off (central 7461, agent 7463)"),
    ("central", "central", str, "agent: the central service's gRPC host:port"),
    ("quorum", "quorum", _addresses, "quorum service host:port list, comma-separated"),
    ("node", "node", str, "this host's name (default: the host name)"),
    ("redis-url", "redis_url", str, "central: keep incidents in Redis (default: in memory)"),
    ("heartbeat-timeout-ms", "heartbeat_timeout", int, "agent: fail a silent rank after, ms"),
    ("check-interval-ms", "check_interval", int, "agent: min fail-stop check spacing, ms (50)"),
    ("evaluate-interval-ms", "evaluate_interval", int, "central: detector period, ms (200)"),
    ("forward-interval-ms", "forward_interval", int, "agent: forward period, ms (200)"),
    (
        "ingest-forwards-per-s",
        "ingest_forwards_per_s",
        float,
        "central: node-state forwards a second it asks its agents for at most; more agents "
        "forward less often (500)",
    ),
    ("max-batch-records", "max_batch_records", int, "agent: records per forward (2000)"),
    ("max-buffered-records", "max_buffered_records", int, "agent: buffer bound (100000)"),
    ("shutdown-grace-ms", "shutdown_grace", int, "drain time on stop, ms (default 2000)"),
    (
        "on-failure",
        "failure_action",
        str,
        "kill (default): a dead or hung rank's replica is torn down, its processes killed; "
        "report: evicted only, its processes left alone",
    ),
    ("kill-grace-ms", "kill_grace", int, "agent: SIGTERM to SIGKILL on a teardown, ms (1000)"),
)
_HANG_TIMEOUT_FLAG = "hang-timeout-ms"
_MILLISECONDS = {
    "heartbeat_timeout",
    "check_interval",
    "evaluate_interval",
    "forward_interval",
    "shutdown_grace",
    "kill_grace",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line (every flag also reads FTHSDP_HEALTH_<FLAG> from the environment)."""
    parser = argparse.ArgumentParser(
        prog="fthsdp-health",
        description="fthsdp health service: central detectors + dashboard, or a node agent",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help=f"central or agent [env {env_name(ENV_PREFIX, 'mode')}]",
    )
    add_flags(parser, ENV_PREFIX, _FLAGS)
    parser.add_argument(
        f"--{_HANG_TIMEOUT_FLAG}",
        type=int,
        default=None,
        help="central: a collective open this long is a hang, ms (10000) "
        f"[env {env_name(ENV_PREFIX, _HANG_TIMEOUT_FLAG)}]",
    )
    return parser


def resolve_detectors(args: argparse.Namespace, env: Mapping[str, str]) -> DetectorConfig:
    """The central detectors' settings that have a flag; the rest are changed over HTTP."""
    hang_ms = flag_or_env(args, env, ENV_PREFIX, _HANG_TIMEOUT_FLAG, int)
    if hang_ms is None:
        return DetectorConfig()
    if hang_ms <= 0:
        raise ValueError(f"{_HANG_TIMEOUT_FLAG} must be positive, got {hang_ms}")
    return DetectorConfig(hang_timeout_s=hang_ms / 1000)


def resolve_config(args: argparse.Namespace, env: Mapping[str, str]) -> HealthConfig:
    """HealthConfig from flags, then FTHSDP_HEALTH_* variables, then defaults.

    Raises ValueError (naming the variable) for an unparsable or invalid value."""
    mode: Mode = flag_or_env(args, env, ENV_PREFIX, "mode", str) or "central"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    grpc_port, http_port = DEFAULT_PORTS[mode]
    values: dict[str, Any] = {
        "mode": mode,
        "port": grpc_port,
        "http_port": http_port,
        "node": socket.gethostname() or "localhost",
    }
    values.update(
        config_values(
            args,
            env,
            ENV_PREFIX,
            _FLAGS,
            milliseconds=_MILLISECONDS,
            off_when_negative={"http_port"},
        )
    )
    return HealthConfig(**values)


async def serve(
    config: HealthConfig,
    token: Token,
    *,
    detectors: DetectorConfig | None = None,
    out: Any = None,
) -> None:
    """Runs until SIGTERM/SIGINT, then drains for `shutdown_grace`."""
    node = HealthProcess(config, token, detectors=detectors)
    await serve_until_signalled(node, lambda: _banner(node), out)


def _banner(node: HealthProcess) -> str:
    http = f"{node.http_url}/dashboard" if node.http_url else "http off"
    return (
        f"fthsdp-health listening on {node.grpc_address} and {http} "
        f"({node.config.mode}, {SERVICE_NAME}; open the dashboard as {http}#token=...)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console script `fthsdp-health`."""
    args = build_parser().parse_args(argv)
    env = os.environ
    try:
        setup_logging(args, env)
        config = resolve_config(args, env)
        detectors = resolve_detectors(args, env)
        token = load_token(path=args.token_file, env=dict(env))
    except (ValueError, OSError) as exc:
        print(f"fthsdp-health: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config, token, detectors=detectors))
    except OSError as exc:
        print(f"fthsdp-health: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
