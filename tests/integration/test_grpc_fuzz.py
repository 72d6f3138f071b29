"""A bounded fuzzer against both gRPC services: valid messages mutated at random (bytes flipped,
cut, repeated, varints inserted), with the token. Every answer must be a clean status, never
UNKNOWN or INTERNAL, and the service must still answer properly afterwards. The same for the
health HTTP API's settings: a client error, never a 500."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable

import grpc
import httpx
import pytest

from fthsdp.protos import health_pb2 as hpb
from fthsdp.protos import quorum_pb2 as qpb
from fthsdp.services.quorum.client import AsyncQuorumClient
from tests.integration.conftest import QuorumServerFactory
from tests.integration.health_support import NodeFactory, health_nodes, heartbeat

MUTANTS_PER_METHOD = 150
_BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@pytest.fixture
async def make_node(token: str):  # type: ignore[no-untyped-def]
    async with health_nodes(token) as make:
        yield make


def _mutants(seed: bytes, rng: random.Random, count: int) -> list[bytes]:
    ops: list[Callable[[bytearray], None]] = [
        lambda b: b.__setitem__(rng.randrange(len(b)), rng.randrange(256)) if b else None,
        lambda b: b.__delitem__(slice(rng.randrange(len(b) + 1), None)),
        lambda b: b.extend(b[: rng.randrange(len(b) + 1)] * rng.randrange(1, 4)),
        lambda b: b.__setitem__(
            slice(rng.randrange(len(b) + 1), None),
            bytes([rng.randrange(1, 32) << 3 | rng.randrange(6)]) + b"\xff" * rng.randrange(11),
        ),
    ]
    out = []
    for _ in range(count):
        data = bytearray(seed)
        for _ in range(rng.randrange(1, 4)):
            rng.choice(ops)(data)
        out.append(bytes(data))
    return out


async def _fire(address: str, token: str, method: str, bodies: list[bytes]) -> set[str]:
    codes, broken = set(), []
    metadata = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(method)
        for body in bodies:
            try:
                await call(body, metadata=metadata, timeout=0.5)
                codes.add("OK")
            except grpc.aio.AioRpcError as err:
                if err.code() in _BROKEN:
                    broken.append((body, err.code(), err.details()))
                codes.add(err.code().name)
    assert not broken, (method, broken[:3])
    return codes


async def test_mutated_quorum_requests_get_clean_answers(
    make_quorum_server: QuorumServerFactory, token: str
) -> None:
    server = await make_quorum_server()
    rank = qpb.RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")
    seeds = {
        "Join": qpb.JoinRequest(replica_id="r0", world_size=1, ranks=[rank]),
        "Heartbeat": qpb.HeartbeatRequest(replica_id="r0", incarnation=1),
        "ReportFailure": qpb.ReportFailureRequest(replica_id="r0", reason="x", reporter="t"),
        "Leave": qpb.LeaveRequest(replica_id="r0", incarnation=1, reason="x"),
        "Status": qpb.StatusRequest(history_limit=3),
        "Quorum": qpb.QuorumRequest(replica_id="r0", incarnation=1, step=0),
    }
    rng = random.Random(20261203)
    started = time.monotonic()
    for name, message in seeds.items():
        count = 30 if name == "Quorum" else MUTANTS_PER_METHOD  # a valid ask may wait its 0.5 s
        bodies = _mutants(message.SerializeToString(), rng, count)
        await _fire(server.address, token, f"/fthsdp.v1.QuorumService/{name}", bodies)
    print(f"fuzzed the quorum service in {time.monotonic() - started:.1f} s")
    client = AsyncQuorumClient(server.address, token)
    try:
        assert (await client.status()).quorum_id >= 0  # still serving
    finally:
        await client.close()


async def test_mutated_health_reports_get_clean_answers(make_node: NodeFactory, token: str) -> None:
    node = await make_node()
    seed = hpb.ReportRequest(source="r0/0", host="h", sent_at=time.time())
    seed.heartbeats.append(heartbeat("r0"))
    step = seed.steps.add(step=1, started_at=time.time(), duration_s=0.1, tokens=10)
    step.rank.CopyFrom(heartbeat("r0").rank)
    rng = random.Random(3)
    bodies = _mutants(seed.SerializeToString(), rng, 3 * MUTANTS_PER_METHOD)
    await _fire(node.grpc_address, token, "/fthsdp.v1.HealthService/Report", bodies)
    assert node.is_ready()


def _json_mutants(rng: random.Random, count: int) -> list[bytes]:
    """Detector settings with random keys, types and magnitudes, and broken JSON."""
    names = ["slow_rank_window", "heartbeat_timeout_s", "hang_timeout_s", "fail_slow_policy"]
    values: list[object] = [0, -1, 1, 2**63, 2**64, 1e-300, 1e300, 0.5, True, None, "x", [], {}]
    out = []
    for _ in range(count):
        body = json.dumps({rng.choice(names): rng.choice(values) for _ in range(rng.randrange(3))})
        if rng.random() < 0.3:
            cut = rng.randrange(len(body) + 1)
            body = body[:cut] + rng.choice(["", "}", "\x00", "\\ud800", "NaN", "[[[["]) + body[cut:]
        out.append(body.encode())
    return out


async def test_mutated_detector_settings_are_400_never_500(
    make_node: NodeFactory, token: str
) -> None:
    node = await make_node()
    headers = {"authorization": f"Bearer {token}"}
    statuses = set()
    async with httpx.AsyncClient(base_url=node.http_url or "", headers=headers) as http:
        before = (await http.get("/v1/detectors")).json()
        for body in _json_mutants(random.Random(7), 300):
            response = await http.put("/v1/detectors", content=body)
            assert response.status_code < 500, (body, response.text)
            statuses.add(response.status_code)
        assert (await http.get("/livez")).status_code == 200
        await http.put("/v1/detectors", json=before)  # whatever valid change a mutant made
    assert 400 in statuses
