"""Quorum round latency and failure detection of the quorum service.

    python -m bench.quorum --replicas 2,16,128,1024 --steps 10 --json quorum.json

Each size runs with the in-memory store and with the Redis store (leader lease, fenced writes
through to a local redis-server with an fsync'd append-only file), side by side
(`--stores`). Then `bench.quorum_failover` measures failover: leader SIGKILL -> the next quorum
served by the standby (`--failover-trials`).

For each size N: the service runs in its own process; N replica leaders (AsyncQuorumClient, many
per process on one shared channel, spread over --processes client processes) join and run K
consecutive steps. Reported per round, over the steady steps (step 0, which ships every
endpoint, is excluded):
  * server: from the round's last arrival to every participant answered (measured in the service);
  * client: from the last leader's request sent to the last leader answered (system-wide
    monotonic clock, so it spans client processes) -- it includes the clients' own decoding of N
    responses of N members each in one Python process, so it overstates what one leader sees.
Then one leader dies (stops calling and heartbeating; ReportFailure is not used) and the
survivors ask for the next step: detection = from its last sign of life to every survivor holding
the new quorum (heartbeat timeout 1 s). Prints a table and writes JSON. Not a pass/fail test."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import secrets
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from fthsdp.bench.quorum_failover import run_failover
from fthsdp.deploy.local_redis import LocalRedis
from fthsdp.services.common import logs
from fthsdp.services.quorum.client import (
    CHANNEL_OPTIONS,
    AsyncQuorumClient,
    QuorumDecodeCache,
    RankEndpoint,
)
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.server import QuorumServer

HEARTBEAT_TIMEOUT = timedelta(seconds=1)
BEAT_EVERY = 0.25  # seconds; a leader beats only when it made no call for this long
QUORUM_TIMEOUT = timedelta(seconds=120)
LEADERS_PER_CHANNEL = 64


def _serve(conn: Connection, token: str, redis_url: str | None) -> None:
    """Service process: reports its address once it leads, runs until told to stop, returns
    round timings."""
    logs.configure("ERROR")  # evictions are expected here; keep the table clean

    async def main() -> None:
        config = QuorumConfig(
            port=0,
            admin_port=None,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            join_timeout=timedelta(seconds=30),
            redis_url=redis_url,
            redis_prefix=f"bench:{secrets.token_hex(4)}",
        )
        server = QuorumServer(config, token)
        await server.start()
        while not server.is_leader:
            await asyncio.sleep(0.01)
        conn.send(server.address)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        timings = [(t.round, t.participants, t.seconds) for t in server.round_timings()]
        await server.stop(timedelta(seconds=1))
        conn.send(timings)

    asyncio.run(main())


def _lead(
    conn: Connection, address: str, token: str, ids: list[str], steps: int, victim: str
) -> None:
    """Client process: N leaders; reports per-step send/answer times and detection."""
    asyncio.run(_leaders(conn, address, token, ids, steps, victim))


async def _leaders(
    conn: Connection, address: str, token: str, ids: list[str], steps: int, victim: str
) -> None:
    # A few connections, as a few hosts would have (hundreds of long polls on one HTTP/2
    # connection is not what a job looks like).
    channels = [
        grpc.aio.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.channel_id", i)])
        for i in range(max(1, len(ids) // LEADERS_PER_CHANNEL))
    ]
    # Every leader of a round gets the same bytes: decode them once per process (as the paper's
    # CPU emulation of many replicas per process would), not once per emulated leader.
    shared = QuorumDecodeCache()
    clients = {
        rid: AsyncQuorumClient(
            address, token, channel=channels[i % len(channels)], decode_cache=shared
        )
        for i, rid in enumerate(ids)
    }
    ranks = [RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")]
    incs = dict(
        zip(ids, await asyncio.gather(*(clients[r].join(r, ranks) for r in ids)), strict=True)
    )
    last_call = dict.fromkeys(ids, time.monotonic())
    alive = set(ids)

    async def beat() -> None:
        while True:
            await asyncio.sleep(BEAT_EVERY / 2)
            now = time.monotonic()
            due = [r for r in alive if now - last_call[r] >= BEAT_EVERY]
            await asyncio.gather(*(clients[r].heartbeat(r, incs[r]) for r in due))
            for r in due:
                last_call[r] = time.monotonic()

    async def run(rid: str) -> list[tuple[float, float]]:
        """One leader's loop: the next step as soon as its own quorum arrived."""
        times = []
        for step in range(steps if rid == victim else steps + 1):
            sent = time.monotonic()
            await clients[rid].quorum(rid, incs[rid], step, timeout=QUORUM_TIMEOUT)
            last_call[rid] = time.monotonic()
            times.append((sent, last_call[rid]))
        if rid == victim:  # dies: no call, no heartbeat from now on
            alive.discard(rid)
        return times

    beater = asyncio.create_task(beat())
    conn.send("joined")
    conn.recv()  # every process joined: start together
    per_leader = dict(zip(ids, await asyncio.gather(*(run(r) for r in ids)), strict=True))
    rounds = [
        (max(t[step][0] for t in per_leader.values()), max(t[step][1] for t in per_leader.values()))
        for step in range(steps)
    ]
    died = per_leader[victim][-1][1] if victim in per_leader else None
    survivors = [t[steps][1] for r, t in per_leader.items() if r != victim]
    detected = max(survivors, default=None)
    beater.cancel()
    for channel in channels:
        await channel.close(None)
    conn.send({"rounds": rounds, "died": died, "detected": detected})


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_size(n: int, steps: int, processes: int, redis_url: str | None = None) -> dict[str, Any]:
    """One size: service process (Redis store when `redis_url`) + client processes; returns the
    measurements."""
    ctx = mp.get_context("spawn")
    token = secrets.token_urlsafe(24)
    server_end, server_conn = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(server_conn, token, redis_url), daemon=True)
    server.start()
    address = server_end.recv()
    ids = [f"replica-{i:04d}" for i in range(n)]
    victim = ids[0]
    groups = [ids[i::processes] for i in range(processes) if ids[i::processes]]
    workers = []
    for group in groups:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(
            target=_lead, args=(theirs, address, token, group, steps, victim), daemon=True
        )
        proc.start()
        workers.append((proc, mine))
    for _, conn in workers:
        assert conn.recv() == "joined"
    for _, conn in workers:
        conn.send("go")
    reports = [conn.recv() for _, conn in workers]
    for proc, _ in workers:
        proc.join(30)
    server_end.send("stop")
    timings = server_end.recv()
    server.join(30)

    client_rounds = [
        max(r["rounds"][step][1] for r in reports) - max(r["rounds"][step][0] for r in reports)
        for step in range(1, steps)
    ]
    server_rounds = [seconds for _, participants, seconds in timings if participants == n][1:]
    died = next(r["died"] for r in reports if r["died"] is not None)
    detected = max(r["detected"] for r in reports if r["detected"] is not None)
    return {
        "replicas": n,
        "store": "redis" if redis_url else "memory",
        "steps": steps,
        "client_processes": len(groups),
        "server_ms": [s * 1000 for s in server_rounds],
        "client_ms": [s * 1000 for s in client_rounds],
        "server_p50_ms": _percentile(server_rounds, 0.5) * 1000,
        "server_p99_ms": _percentile(server_rounds, 0.99) * 1000,
        "client_p50_ms": _percentile(client_rounds, 0.5) * 1000,
        "client_p99_ms": _percentile(client_rounds, 0.99) * 1000,
        "detection_s": detected - died,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.quorum", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--replicas", default="2,16,128,1024", help="comma-separated sizes")
    parser.add_argument("--steps", type=int, default=10, help="consecutive steps per size (>= 2)")
    parser.add_argument(
        "--processes", type=int, default=0, help="client processes (0: 1 up to 128 leaders, else 2)"
    )
    parser.add_argument(
        "--stores", default="memory,redis", help="memory and/or redis, side by side per size"
    )
    parser.add_argument(
        "--failover-trials", type=int, default=5,
        help="leader kills for the failover measurement (0 skips it; needs redis-server)",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.replicas.split(",") if s]
    stores = [s for s in args.stores.split(",") if s]
    if args.steps < 2 or any(n < 2 for n in sizes):
        parser.error("need --steps >= 2 and every size >= 2 (one replica dies)")
    if not set(stores) <= {"memory", "redis"}:
        parser.error("--stores takes memory and/or redis")
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-redis-") as tmp:
        redis = None
        if "redis" in stores or args.failover_trials:
            redis = LocalRedis(Path(tmp), password=secrets.token_hex(8))
            redis.start()
        try:
            results = _latency_table(sizes, stores, args, redis)
            failover = run_failover(redis.url, args.failover_trials) if redis else None
        finally:
            if redis is not None:
                redis.stop()
    if args.json:
        with open(args.json, "w") as out:
            report = {"benchmark": "quorum", "results": results, "failover": failover}
            json.dump(report, out, indent=2)
    return 0


def _latency_table(
    sizes: list[int], stores: list[str], args: argparse.Namespace, redis: LocalRedis | None
) -> list[dict[str, Any]]:
    results = []
    header = f"{'replicas':>8} {'store':>6} {'steps':>5} {'server p50':>11} {'server p99':>11} "
    header += f"{'client p50':>11} {'client p99':>11} {'detection':>10}"
    print(header)
    for n in sizes:
        processes = args.processes or (1 if n <= 128 else 2)
        for store in stores:
            url = redis.url if store == "redis" and redis is not None else None
            r = run_size(n, args.steps, processes, url)
            results.append(r)
            print(
                f"{n:>8} {store:>6} {args.steps:>5} {r['server_p50_ms']:>9.2f}ms "
                f"{r['server_p99_ms']:>9.2f}ms {r['client_p50_ms']:>9.2f}ms "
                f"{r['client_p99_ms']:>9.2f}ms {r['detection_s']:>9.3f}s",
                flush=True,
            )
    print("targets: server p99 <= 5 ms at 16 replicas, <= 50 ms at 1024; detection <= 1 s + slack")
    return results


if __name__ == "__main__":
    sys.exit(main())
