"""What surrounds the emulated ranks of `bench.scale`: the leaders' heartbeats (on a loop of their
own), the node agent of a host where a rank dies (the real `NodeAgent`, run by the orchestrator),
the other node agents' forwarding to the central health service, the decode cache that counts
the quorum answers' bytes, and the memos that keep per-leader and per-rank work that real hosts
do in parallel from being repeated thousands of times on two cores."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc

from fthsdp.bench.scale_model import percentile
from fthsdp.protos import quorum_pb2 as qpb
from fthsdp.protos.health_pb2 import ReportRequest, ReportResponse
from fthsdp.services.common.process_ref import ProcessRef, process_start
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.agent import NodeAgent
from fthsdp.services.health.client_codec import (
    NodeRank,
    NodeState,
    ReportBatch,
    batch_to_pb,
)
from fthsdp.services.health.config import HealthConfig
from fthsdp.services.health.forward_pacing import CHANNEL_OPTIONS as FORWARD_CHANNEL_OPTIONS
from fthsdp.services.health.forward_pacing import ForwardPacing, reached_busy_central
from fthsdp.services.health.metrics import HealthMetrics
from fthsdp.services.health.quorum_reporter import Outcome, QuorumReporter
from fthsdp.services.health.telemetry import Heartbeat, RankId
from fthsdp.services.quorum.client import (
    CHANNEL_OPTIONS,
    AsyncQuorumClient,
    Quorum,
    QuorumDecodeCache,
)
from fthsdp.worker.plan import decode_plan, encode_steady, steady_max_step

REPORT = "/fthsdp.v1.HealthService/Report"
T = TypeVar("T")


class CountingCache(QuorumDecodeCache):
    """The clients' shared decode cache (as in bench.quorum), counting the bytes of every
    QuorumResponse that reaches a leader, by phase (the size of the message as received)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.bytes: dict[str, int] = {}
        self.responses: dict[str, int] = {}
        self._sizes: dict[tuple[int, int, int, int], int] = {}

    def decode(self, msg: qpb.QuorumResponse, replica_id: str) -> Quorum | None:
        # Every participant of a round gets the same shared part: measure each distinct one
        # once; the endpoints each caller needs come on top.
        key = (msg.quorum_id, msg.max_step, msg.members_form, len(msg.members))
        size = self._sizes.get(key)
        if size is None:
            if len(self._sizes) > 64:
                self._sizes.clear()
            size = self._sizes[key] = msg.ByteSize() - _endpoints_bytes(msg)
        size += _endpoints_bytes(msg)
        self.bytes[self.phase] = self.bytes.get(self.phase, 0) + size
        self.responses[self.phase] = self.responses.get(self.phase, 0) + 1
        return super().decode(msg, replica_id)


def _endpoints_bytes(msg: qpb.QuorumResponse) -> int:
    """The wire size of the answer's `endpoints` field: each entry's tag, length and body."""
    total = 0
    for entry in msg.endpoints:
        body = entry.ByteSize()
        total += 1 + _varint_bytes(body) + body
    return total


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


@dataclass(slots=True)
class Plans:
    """The worker's plan code (`worker.plan`) run once per distinct input in this process: every
    leader of a round encodes the same quorum, and every rank decodes the same payload, each on
    its own host in a real job. The first (real) call's CPU time (of this thread: not the time
    it waited for the GIL or a core) is what each of them would spend."""

    encode_s: list[float] = field(default_factory=list)
    steady_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    _encoded: dict[tuple[int, Any], tuple[Quorum, bytes]] = field(default_factory=dict)
    _steady: dict[tuple[int, int], tuple[bytes, bytes, int | None]] = field(default_factory=dict)
    _parsed: dict[int, tuple[bytes, dict[str, int], list[Any]]] = field(default_factory=dict)

    def payload(
        self, quorum: Quorum, replica_id: str, previous: tuple[Quorum, bytes] | None
    ) -> bytes:
        """The leader's broadcast (`encode_steady` after its `previous` quorum and payload, as
        QuorumLink), shared by leaders whose payload is equal."""
        sources = quorum.sources.get(replica_id)
        mine = (replica_id in quorum.healthy and bool(quorum.sources), sources)
        key = (id(quorum), mine if quorum.sources else None)
        hit = self._encoded.get(key)
        if hit is not None and hit[0] is quorum:
            return hit[1]
        started = time.thread_time()
        data = encode_steady(previous, quorum, replica_id)
        self.encode_s.append(time.thread_time() - started)
        _bound(self._encoded)
        self._encoded[key] = (quorum, data)
        return data

    def steady(self, previous: bytes | None, payload: bytes) -> int | None:
        """`steady_max_step(previous, payload)`, once per pair of payloads."""
        if previous is None:
            return None
        key = (id(previous), id(payload))
        hit = self._steady.get(key)
        if hit is not None and hit[0] is previous and hit[1] is payload:
            return hit[2]
        started = time.thread_time()
        step = steady_max_step(previous, payload)
        self.steady_s.append(time.thread_time() - started)
        _bound(self._steady)
        self._steady[key] = (previous, payload, step)
        return step

    def members(self, payload: bytes, replica_id: str) -> tuple[dict[str, int], list[Any]]:
        """The payload's ring order (replica id -> position) and members; the first time, also
        one real `decode_plan` (what every rank runs on the payload), timed."""
        hit = self._parsed.get(id(payload))
        if hit is not None and hit[0] is payload:
            return hit[1], hit[2]
        started = time.thread_time()
        decode_plan(payload, replica_id=replica_id, rank=0)
        self.decode_s.append(time.thread_time() - started)
        members = json.loads(payload)["members"]
        order = {m["replica_id"]: p for p, m in enumerate(members)}
        _bound(self._parsed)
        self._parsed[id(payload)] = (payload, order, members)
        return order, members

    def summary(self) -> dict[str, Any]:
        return {
            "encode_ms": _ms(self.encode_s),
            "steady_check_ms": _ms(self.steady_s),
            "decode_ms": _ms(self.decode_s),
        }


def _bound(memo: dict[Any, Any], size: int = 8) -> None:
    if len(memo) >= size:
        memo.clear()


def _ms(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "median": None if not values else 1000 * (percentile(values, 0.5) or 0.0),
        "max": None if not values else 1000 * max(values),
    }


# ---- leaders' heartbeats ----------------------------------------------------------------------


class Beating(Protocol):
    """What the heartbeat thread reads of a leader (attribute reads only)."""

    name: str
    incarnation: int
    alive: bool
    last_call: float
    held: int
    """The incarnation its Watch stream keeps alive (0: none): no beats are needed then."""


class SideLoop:
    """An event loop on its own thread: what runs on a host's own threads in a real job (a
    leader's heartbeat thread, the node agent) runs here, so that the busy emulation loop of the
    ranks delays it no more than the GIL does."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the side loop; awaitable from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        """Stops the loop and closes it (its selector and self-pipe with it)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass(slots=True)
class Heartbeats:
    """The leaders' heartbeats (`QuorumLink.heartbeat_loop`): each leader beats when no request
    of it reached the service for `interval_s` and its Watch stream does not keep its current
    incarnation alive, independently of the others."""

    sent: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    stopping: bool = False

    async def run(
        self, address: str, token: str, leaders: Sequence[Beating], interval_s: float, per: int
    ) -> None:
        channels = [
            grpc.aio.insecure_channel(
                address, options=[*CHANNEL_OPTIONS, ("grpc.channel_id", 200_000 + i)]
            )
            for i in range(max(1, len(leaders) // per))
        ]
        clients = [AsyncQuorumClient(address, token, channel=c) for c in channels]
        await asyncio.gather(
            *(self._beat(clients[k % len(clients)], leader, interval_s)
              for k, leader in enumerate(leaders))
        )  # fmt: skip
        for channel in channels:
            await channel.close(None)

    async def _beat(self, client: AsyncQuorumClient, leader: Beating, interval_s: float) -> None:
        beaten = 0.0
        while not self.stopping:
            quiet = time.monotonic() - max(leader.last_call, beaten)
            if quiet < interval_s or not leader.alive or leader.held == leader.incarnation:
                await asyncio.sleep(max(0.01, interval_s - quiet))
                continue
            beaten = time.monotonic()
            try:
                await client.heartbeat(leader.name, leader.incarnation)
                self.sent += 1
            except Exception as exc:  # the quorum request path rejoins; keep beating
                self.failed += 1
                kind = type(exc).__name__
                self.errors[kind] = self.errors.get(kind, 0) + 1


# ---- the node agent of a host where a rank dies -----------------------------------------------


class TimedReporter(QuorumReporter):
    """The agent's real QuorumReporter, timestamping each report (start, end, outcome)."""

    def __init__(self, address: str, token: Token) -> None:
        super().__init__([address], token)
        self.reports: list[tuple[float, float, str, str]] = []

    async def report_failure(
        self, replica_id: str, reason: str, *, reporter: str, **options: Any
    ) -> Outcome:
        started = time.monotonic()
        outcome = await super().report_failure(replica_id, reason, reporter=reporter, **options)
        self.reports.append((started, time.monotonic(), replica_id, outcome))
        return outcome


class VictimHost:
    """A host with a rank that will die: the real `NodeAgent` (fail-stop detection, the exit
    watch, report to the quorum service, teardown, forwarding to the central service), fed by
    its ranks' heartbeats every `beat_s` in-process (each rank's TelemetryClient beating to its
    local agent). Each rank has a real process (a sleep) that its beats name, so a death is a
    SIGKILL the agent sees as the rank's own would be, or, with `hang`, a silence. Once the
    agent has reported the death, its replica is torn down: the host's ranks beat no more."""

    def __init__(
        self,
        *,
        host: str,
        replica_id: str,
        ranks: Sequence[int],
        quorum: str,
        central: str,
        token: str,
        beat_s: float,
        hang: bool = False,
    ) -> None:
        secret = Token(token)
        config = HealthConfig(
            mode="agent", port=0, http_port=None, node=host, central=central, quorum=(quorum,)
        )
        self.reporter = TimedReporter(quorum, secret)
        self.agent = NodeAgent(config, secret, HealthMetrics(), quorum=self.reporter)
        self.host, self.replica_id, self.ranks = host, replica_id, list(ranks)
        self._beat_s = beat_s
        self._hang = hang
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._refs: dict[int, ProcessRef] = {}
        self._dead: set[int] = set()
        self._dying: tuple[int, asyncio.Future[float]] | None = None
        self._task: asyncio.Task[None] | None = None
        self.died_at = float("inf")

    async def start(self) -> None:
        for rank in self.ranks:
            proc = self._procs[rank] = subprocess.Popen(["sleep", "86400"])
            self._refs[rank] = ProcessRef(proc.pid, process_start(proc.pid) or 0)
        await self.agent.start()
        self._task = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.agent.stop()
        await self.reporter.close()
        for proc in self._procs.values():
            proc.kill()
            proc.wait()

    async def kill(self, rank: int) -> float:
        """Rank `rank` beats once more and dies right after (SIGKILL to its process; with
        `hang`, it only stops beating, so the agent's silence timeout runs in full); returns
        that moment (monotonic)."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._dying = (rank, future)
        return await future

    async def _beat(self) -> None:
        while True:
            torn_down = bool(self._dead) and any(r[0] > self.died_at for r in self.reporter.reports)
            for rank in self.ranks:
                if rank in self._dead or torn_down:
                    continue
                ref = self._refs[rank]
                beat = Heartbeat(
                    rank=RankId(replica_id=self.replica_id, rank=rank),
                    host=self.host,
                    step=0,
                    at=time.time(),
                    pid=ref.pid,
                    pid_start=ref.start,
                )
                await self.agent.ingest(
                    ReportBatch(source=f"rank:{rank}", host=self.host, heartbeats=(beat,))
                )
            dying, self._dying = self._dying, None
            if dying is not None:
                self._dead.add(dying[0])
                if not self._hang:
                    self._procs[dying[0]].kill()
                self.died_at = time.monotonic()
                dying[1].set_result(self.died_at)
            await asyncio.sleep(self._beat_s)


# ---- the other node agents' forwarding (ingest load on the central service) -------------------


def node_state_request(
    host: str, replica_id: str, ranks: Sequence[int], step: int
) -> ReportRequest:
    """An agent's forward with nothing buffered: its node state (every rank beating). Its
    `sent_at` is stamped at each send (`forward_node_states`): a batch re-sent with an old one
    reads as held up in the network, and central refuses it."""
    state = NodeState(
        node=host,
        ranks=tuple(
            NodeRank(rank=RankId(replica_id=replica_id, rank=i), step=step, silent_s=0.0)
            for i in ranks
        ),
    )
    batch = ReportBatch(source=f"agent:{host}", host=host, node=state)
    return batch_to_pb(batch, sent_at=time.time())


INGEST_SETTLE_S = 60.0
"""At most this long for every agent to hear central's interval before the measurement."""


async def forward_node_states(
    central: str,
    token: str,
    requests: Sequence[tuple[ReportRequest, int]],
    *,
    seconds: float,
    interval_s: float,
    per_channel: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Every agent forwards its node state like `NodeAgent._forward_loop`: sleep its interval
    (or the longer one central's last answer asked for; after a failure, the agent's jittered
    backoff), then one Report with its deadline. Once every agent was answered (or after
    `INGEST_SETTLE_S`), counts what the service acknowledged over `seconds`, or two asked
    intervals if that is longer. `requests`: (encoded request, ranks in it) per agent."""
    metadata = (("authorization", Token(token).header()),)
    channels = [
        grpc.aio.insecure_channel(central, options=[*FORWARD_CHANNEL_OPTIONS, ("agent", i)])
        for i in range(max(1, len(requests) // per_channel))
    ]
    calls = [
        c.unary_unary(REPORT, request_serializer=None, response_deserializer=None) for c in channels
    ]
    acked = failed = entries = 0
    failures: dict[str, int] = {}
    """Failed forwards in the window, by gRPC status."""
    latencies: list[float] = []
    start = time.monotonic()
    answered: set[int] = set()
    asked = 0.0
    window: list[float] = [start + INGEST_SETTLE_S, math.inf]
    """[from, to): the measured window; it starts once every agent was answered."""

    def settle(now: float) -> None:
        if window[1] == math.inf and (len(answered) == len(requests) or now >= window[0]):
            window[0] = now
            window[1] = now + max(seconds, 2 * asked)

    async def agent(k: int, request: ReportRequest, ranks: int) -> None:
        nonlocal acked, failed, entries, asked
        pacing = ForwardPacing(interval_s)
        channel = channels[k % len(channels)]
        call = calls[k % len(calls)]
        delay = interval_s * (1 + k / max(1, len(requests)))  # spread, as hosts are
        while True:
            await asyncio.sleep(delay)
            sent = time.monotonic()
            settle(sent)
            if sent >= window[1]:
                return
            request.sent_at = time.time()
            try:
                answer = await call(
                    request.SerializeToString(), timeout=timeout_s, metadata=metadata
                )
            except grpc.RpcError as err:
                busy = reached_busy_central(err, channel)
                if window[0] <= sent:
                    failed += 1
                    code = err.code().name if isinstance(err, grpc.aio.AioRpcError) else "?"
                    failures[code] = failures.get(code, 0) + 1
                delay = pacing.failed(busy)
                continue
            delay = pacing.answered(ReportResponse.FromString(answer).forward_interval_ms)
            asked = max(asked, pacing.asked_s)
            answered.add(k)
            if window[0] <= sent:
                latencies.append(time.monotonic() - sent)
                acked += 1
                entries += ranks

    cpu0 = time.process_time()
    await asyncio.gather(*(agent(k, d, n) for k, (d, n) in enumerate(requests)))
    cpu = time.process_time() - cpu0
    for channel in channels:
        await channel.close(None)
    return {
        "agents": len(requests),
        "ranks": sum(n for _, n in requests),
        "acked": acked,
        "failed": failed,
        "failed_by_status": failures,
        "rank_entries": entries,
        "asked_interval_s": asked,
        "settle_s": window[0] - start,
        "window_s": window[1] - window[0],
        "phase_s": time.monotonic() - start,
        "client_cpu_s": cpu,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p99_s": percentile(latencies, 0.99),
    }
