"""The node agents' quorum event streams in `bench.scale`: one per host, as `NodeAgent` opens it,
filtered to the host's replica (`WatchRequest.replica_ids`, mode `filtered`), or carrying every
event of the job as each agent's stream did before (`all`), or none (`off`). Each stream counts
what it receives and stamps when it hears its own replica evicted (the event that makes an agent
kill the replica's local processes)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import grpc

from fthsdp.services.common.backoff import Retries
from fthsdp.services.health.quorum_reporter import WATCH_RETRY
from fthsdp.services.quorum.client import (
    CHANNEL_OPTIONS,
    AsyncQuorumClient,
    QuorumError,
)

AGENT_STREAM_MODES = ("filtered", "all", "off")


class AgentStreams:
    """The agents' streams of one client process (`per_channel` to a connection)."""

    def __init__(self, target: str, token: str, mode: str, per_channel: int = 64) -> None:
        if mode not in AGENT_STREAM_MODES:
            raise ValueError(f"agent stream mode must be one of {AGENT_STREAM_MODES}, got {mode}")
        self._target, self._token, self.mode = target, token, mode
        self._per_channel = per_channel
        self._channels: list[grpc.aio.Channel] = []
        self._clients: list[AsyncQuorumClient] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.live = 0
        """Streams whose snapshot arrived."""
        self.messages = 0
        """Events received (snapshots excepted) since `arm`."""
        self.failures = 0
        """Streams that failed (each opened again after a backoff)."""
        self.failure_reasons: Counter[str] = Counter()
        """Those failures by error class and message."""
        self._heard: dict[str, list[float]] = {}

    async def open(self, hosts: Sequence[tuple[str, int]], deadline: float) -> dict[str, Any]:
        """One stream per host of each (replica, hosts); waits until every snapshot arrived or
        the deadline (monotonic) passed."""
        total = sum(n for _, n in hosts) if self.mode != "off" else 0
        count = max(1, -(-total // self._per_channel))
        if total:
            self._channels = [
                grpc.aio.insecure_channel(
                    self._target, options=[*CHANNEL_OPTIONS, ("grpc.channel_id", 300_000 + i)]
                )
                for i in range(count)
            ]
            self._clients = [
                AsyncQuorumClient(self._target, self._token, channel=c) for c in self._channels
            ]
        k = 0
        for replica, n in hosts if total else ():
            for _ in range(n):
                client = self._clients[k % len(self._clients)]
                self._tasks.append(asyncio.create_task(self._follow(replica, client)))
                k += 1
        while self.live < total and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return {
            "agent_streams_total": total,
            "agent_streams_live": self.live,
            "agent_stream_failures": self.failures,
            "agent_stream_failure_reasons": dict(self.failure_reasons),
        }

    async def _follow(self, replica: str, client: AsyncQuorumClient) -> None:
        """One agent's stream, opened again after the agent's own backoff (`WATCH_RETRY`)
        whenever it fails, as `QuorumReporter.teardowns` does."""
        retries, live = Retries(WATCH_RETRY), False
        while True:
            try:
                async for event in client.watch(
                    replicas=(replica,) if self.mode == "filtered" else None
                ):
                    if event.kind == "snapshot":
                        retries.succeeded()
                        self.live += not live
                        live = True
                    else:
                        self.messages += 1
                        if event.kind == "evicted" and event.replica_id == replica:
                            self._heard.setdefault(replica, []).append(time.monotonic())
            except QuorumError as exc:
                self.failures += 1
                self.failure_reasons[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
            await asyncio.sleep(retries.failed())

    def arm(self) -> None:
        """A failure starts: counts and stamps from now."""
        self.messages = 0
        self._heard.clear()

    def heard(self, replica: str) -> list[float]:
        """When each of `replica`'s agents heard it evicted (since `arm`)."""
        return list(self._heard.get(replica, ()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in self._clients:
            await client.close()  # cancels its streams; the shared channel is closed below
        for channel in self._channels:
            await channel.close(None)
