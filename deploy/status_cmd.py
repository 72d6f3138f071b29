"""`fthsdp status`: replicas, recent incidents and the quorum history, read from the health
service's HTTP API."""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from fthsdp.services.common.tokens import load_token
from fthsdp.services.health.client_http import HealthClient
from fthsdp.services.health.domain import HealthError

DEFAULT_URL = "http://127.0.0.1:7461"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Registers `status` on the `fthsdp` command line."""
    p = sub.add_parser(
        "status",
        help="show replicas, incidents and quorum history from the health service",
        description="Reads the health service's HTTP API (GET /v1/replicas, /v1/incidents, "
        "/v1/quorum/history) and prints it.",
    )
    p.add_argument(
        "--health-url",
        default=os.environ.get("FTHSDP_HEALTH_URL", DEFAULT_URL),
        help=f"base URL of the health service [env FTHSDP_HEALTH_URL] (default {DEFAULT_URL})",
    )
    p.add_argument(
        "--token-file", help="file holding the bearer token [else FTHSDP_TOKEN, FTHSDP_TOKEN_FILE]"
    )
    p.add_argument("--incidents", type=int, default=10, help="recent incidents to show (10)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Prints the status; 0 on success, 1 when the service cannot be read."""
    try:
        token = load_token(path=args.token_file)
        with HealthClient(args.health_url, token) as client:
            status = {
                "replicas": client.replicas(),
                "incidents": client.incidents(limit=max(1, min(args.incidents, 1000))),
                "quorum": client.quorum_history(limit=16),
            }
    except (HealthError, ValueError, OSError) as exc:
        print(f"fthsdp status: {exc}", file=out)
        return 1
    if args.json:
        print(json.dumps(status, indent=2), file=out)
    else:
        print(render(status), file=out)
    return 0


def _clock(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def _ago(now: float, t: float | None) -> str:
    return "-" if t is None else f"{max(0.0, now - t):.1f}s ago"


def render(status: dict[str, Any]) -> str:
    """The status as text tables."""
    replicas = status["replicas"]
    now = replicas.get("now") or time.time()
    lines = ["REPLICA          STATE     STEP    RANKS  HOSTS                LAST SEEN"]
    for r in replicas["replicas"]:
        lines.append(
            f"{r['replica_id']:<16} {r['state']:<9} {r['last_step']:<7} {r['ranks']:<6} "
            f"{','.join(r['hosts'])[:20]:<20} {_ago(now, r['last_seen'])}"
        )
    if not replicas["replicas"]:
        lines.append("(no replicas reported yet)")
    lines += ["", "INCIDENTS (newest first)"]
    for i in status["incidents"]:
        lines.append(f"{_clock(i['detected_at'])} UTC  {i['kind']:<10} {i['summary']}")
    if not status["incidents"]:
        lines.append("(none)")
    quorum = status["quorum"]
    lines += ["", "QUORUM HISTORY (newest first)"]
    if not quorum["configured"]:
        lines.append("(the health service has no quorum address)")
    for q in reversed(quorum["quorums"]):
        lines.append(
            f"{_clock(q['formed_at'])} UTC  id {q['quorum_id']:<6} step {q['max_step']:<7} "
            f"members {','.join(q['members'])}  ({q['reason']})"
        )
    decisions = quorum.get("failslow", [])
    if decisions:
        lines += ["", "FAIL-SLOW DECISIONS (newest first)"]
    for d in reversed(decisions):
        moved = ",".join(f"{r}={k}" for r, k in sorted(d["shares"].items())) or "even"
        evicted = f" evicted {','.join(d['evicted'])}" if d["evicted"] else ""
        lines.append(
            f"{_clock(d['decided_at'])} UTC  step {d['step']:<7} {d['action']:<9} "
            f"micro-steps {moved}{evicted}  ({d['reason']})"
        )
    return "\n".join(lines)
