"""`python -m fthsdp.services.quorum` / `fthsdp-quorum`: run the quorum service.

Flags carry units; each falls back to an `FTHSDP_QUORUM_*` environment variable, then to the
`QuorumConfig` default (flag > env > default). This is the only module that reads the
environment. SIGTERM or SIGINT drains gracefully; a second SIGINT exits at once."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fthsdp.services.common.cli import Flag, add_flags, config_values, setup_logging
from fthsdp.services.common.signals import serve_until_signalled
from fthsdp.services.common.tokens import Token, load_token
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.server import SERVICE_NAME, QuorumServer
from fthsdp.services.quorum.store import InMemoryStore, clock_epoch_floor

log = logging.getLogger("fthsdp.services.quorum")

ENV_PREFIX = "FTHSDP_QUORUM_"
_FLAGS: tuple[Flag, ...] = (
    ("host", "host", str, "interface to bind (default 127.0.0.1)"),
    ("port", "port", int, "gRPC port, 0 = any free port (default 7450)"),
    ("admin-port", "admin_port", int, "HTTP port for /metrics /livez /readyz, 0 = any, -1 = off"),
    ("min-replicas", "min_replicas", int, "smallest quorum (default 1)"),
    ("join-timeout-ms", "join_timeout", int, "wait for live stragglers, ms (default 2000)"),
    (
        "catchup-timeout-ms",
        "catchup_timeout",
        int,
        "wait for a replica catching up again after its last catch-up outlasted the join "
        "timeout, ms (default 60000)",
    ),
    ("heartbeat-timeout-ms", "heartbeat_timeout", int, "evict after silence, ms (default 1000)"),
    ("history-size", "history_size", int, "recent quorums kept for Status (default 128)"),
    ("shutdown-grace-ms", "shutdown_grace", int, "drain time on stop, ms (default 5000)"),
    (
        "redis-url",
        "redis_url",
        str,
        "durable store + leader election, redis://[:password@]host:port/db; instances with the "
        "same URL and prefix elect one leader, the others stand by (default: in memory)",
    ),
    ("redis-prefix", "redis_prefix", str, "key prefix in Redis (default fthsdp:quorum)"),
    ("lease-ttl-ms", "lease_ttl", int, "leader lease lifetime, ms (default 1000)"),
    (
        "failslow-policy",
        "failslow_policy",
        str,
        "fail-slow mitigation: off | rebalance | evict | auto (default off); moves micro-steps "
        "between replicas or evicts a slow one",
    ),
    ("failslow-horizon-ms", "failslow_horizon", int, "planner horizon, ms (default 60000)"),
    (
        "failslow-evict-cost-ms",
        "failslow_evict_cost",
        int,
        "what an eviction costs the job, ms (default 10000)",
    ),
)
_MILLISECONDS = {
    "join_timeout",
    "catchup_timeout",
    "heartbeat_timeout",
    "shutdown_grace",
    "lease_ttl",
    "failslow_horizon",
    "failslow_evict_cost",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line (every flag also reads FTHSDP_QUORUM_<FLAG> from the environment)."""
    parser = argparse.ArgumentParser(
        prog="fthsdp-quorum", description="fthsdp quorum service (gRPC fthsdp.v1.QuorumService)"
    )
    add_flags(parser, ENV_PREFIX, _FLAGS)
    return parser


def resolve_config(args: argparse.Namespace, env: Mapping[str, str]) -> QuorumConfig:
    """QuorumConfig from flags, then FTHSDP_QUORUM_* variables, then defaults.

    Raises ValueError (with the variable's name) for an unparsable environment value."""
    values = config_values(
        args, env, ENV_PREFIX, _FLAGS, milliseconds=_MILLISECONDS, off_when_negative={"admin_port"}
    )
    return QuorumConfig(**values)


async def serve(config: QuorumConfig, token: Token, *, out: Any = None) -> None:
    """Runs the server until SIGTERM/SIGINT, then drains for `shutdown_grace`."""
    # The in-memory store starts its epochs above the wall clock so that a restarted service
    # never reissues an id the previous one handed out (I3 without a durable store).
    store = None
    if config.redis_url is None:
        store = InMemoryStore(history_size=config.history_size, epoch_floor=clock_epoch_floor())
    server = QuorumServer(config, token, store=store)
    await serve_until_signalled(server, lambda: _banner(server), out)


def _banner(server: QuorumServer) -> str:
    admin = f"http://{server.admin_address}/metrics" if server.admin_address else "off"
    role = "leader election via redis" if server.config.redis_url else "in-memory store"
    return (
        f"fthsdp-quorum listening on {server.address} ({SERVICE_NAME}; admin {admin}; {role})\n"
        f"  python: QuorumClient({server.address!r}, token).status()\n"
        f'  grpcurl: grpcurl -plaintext -H "authorization: Bearer $FTHSDP_TOKEN" '
        f"{server.address} {SERVICE_NAME}/Status"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Console script `fthsdp-quorum`."""
    args = build_parser().parse_args(argv)
    env = os.environ
    try:
        setup_logging(args, env)
        config = resolve_config(args, env)
        token = load_token(path=args.token_file, env=dict(env))
    except (ValueError, OSError) as exc:
        print(f"fthsdp-quorum: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config, token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
