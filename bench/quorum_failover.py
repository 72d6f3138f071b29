"""Failover time of the quorum service: a leader and a standby (`python -m services.quorum
--redis-url ...`, lease 1 s) and 4 replica leaders training steps; the leading instance is
SIGKILLed between two steps, and failover = from the kill to every replica holding the next
quorum (served by the standby, with the same quorum id when membership is unchanged). The killed
instance is restarted as the new standby for the next trial.

    python -m bench.quorum_failover --trials 5        (or through python -m bench.quorum)

Target: a standby takes over within 2 s of the leader's death. Not a pass/fail test."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from fthsdp.deploy.local_redis import LocalRedis
from fthsdp.services.quorum.client import AsyncQuorumClient, RankEndpoint

REPLICAS = 4
RANKS = (RankEndpoint(ftar="127.0.0.1:1", checkpoint="http://127.0.0.1:2"),)


class QuorumProcess:
    """One `python -m services.quorum` process on free ports, electing through `redis_url`;
    `leads()` asks its readiness probe (only the leader is ready)."""

    def __init__(
        self, redis_url: str, token: str, prefix: str, *, lease_ttl_ms: int = 1000
    ) -> None:
        # The Redis URL (with its password) and the token travel in the environment.
        env = {**os.environ, "FTHSDP_TOKEN": token, "FTHSDP_QUORUM_REDIS_URL": redis_url}
        argv = [sys.executable, "-m", "fthsdp.services.quorum", "--port", "0", "--admin-port", "0"]
        argv += ["--redis-prefix", prefix, "--lease-ttl-ms", str(lease_ttl_ms)]
        argv += ["--log-level", "ERROR"]
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (\S+) .*admin http://([^/]+)/metrics", line)
        if match is None:
            self.kill()
            raise RuntimeError(f"quorum service did not start: {line!r}")
        self.address, self._admin = match.group(1), match.group(2)

    def leads(self) -> bool:
        """Whether this instance is the leader now."""
        try:
            return httpx.get(f"http://{self._admin}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL (idempotent)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def _step(client: AsyncQuorumClient, members: dict[str, int], step: int) -> int:
    answers = await asyncio.gather(
        *(client.quorum(r, i, step, timeout=timedelta(seconds=30)) for r, i in members.items())
    )
    return answers[0].quorum_id


async def _trials(
    instances: list[QuorumProcess], token: str, trials: int, spawn: Any
) -> list[dict[str, Any]]:
    client = AsyncQuorumClient([i.address for i in instances], token)
    members = {f"r{i}": await client.join(f"r{i}", RANKS) for i in range(REPLICAS)}
    step = 0
    quorum_id = await _step(client, members, step)
    results = []
    for _ in range(trials):
        leader = next(i for i in instances if i.leads())
        killed_at = time.monotonic()
        leader.kill()
        step += 1
        new_id = await _step(client, members, step)
        seconds = time.monotonic() - killed_at
        results.append({"failover_s": seconds, "same_quorum_id": new_id == quorum_id})
        print(f"  trial {len(results)}: {seconds:.3f} s (quorum id kept: {new_id == quorum_id})")
        quorum_id = new_id
        instances.remove(leader)
        instances.append(spawn())  # the restarted instance stands by
        client = AsyncQuorumClient([i.address for i in instances], token)
    await client.close()
    return results


def run_failover(redis_url: str, trials: int) -> dict[str, Any] | None:
    """Runs `trials` leader kills against `redis_url`; prints and returns the summary."""
    if trials <= 0:
        return None
    token = secrets.token_urlsafe(24)
    prefix = f"bench-failover:{secrets.token_hex(4)}"
    instances = [QuorumProcess(redis_url, token, prefix)]
    while not instances[0].leads():
        time.sleep(0.02)
    instances.append(QuorumProcess(redis_url, token, prefix))
    print(f"failover: {trials} leader kills, {REPLICAS} replicas, lease 1 s")
    try:
        results = asyncio.run(
            _trials(instances, token, trials, lambda: QuorumProcess(redis_url, token, prefix))
        )
    finally:
        for instance in instances:
            instance.kill()
    times = [r["failover_s"] for r in results]
    summary = {
        "trials": results,
        "median_s": statistics.median(times),
        "max_s": max(times),
        "target_s": 2.0,
    }
    print(f"failover median {summary['median_s']:.3f} s, max {summary['max_s']:.3f} s (target 2 s)")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quorum_failover", description=__doc__)
    parser.add_argument("--trials", type=int, default=5, help="leader kills (default 5)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-redis-") as tmp:
        redis = LocalRedis(Path(tmp), password=secrets.token_hex(8))
        redis.start()
        try:
            summary = run_failover(redis.url, args.trials)
        finally:
            redis.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"benchmark": "quorum_failover", **(summary or {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
