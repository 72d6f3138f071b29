"""The quorum service's wire contract against a real server: auth, input validation, typed errors,
lean responses, health, metrics, graceful stop, the sync client and the command line."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fthsdp.protos import quorum_pb2 as pb
from fthsdp.protos import quorum_pb2_grpc as pb_grpc
from fthsdp.services.quorum.client import (
    AsyncQuorumClient,
    AuthError,
    InternalError,
    InvalidRequestError,
    MembershipTooLargeError,
    QuorumClient,
    QuorumTimeoutError,
    QuorumUnavailableError,
    RankEndpoint,
    StaleIncarnationError,
    UnknownReplicaError,
    WorldSizeMismatchError,
)
from fthsdp.services.quorum.server import QuorumServer, QuorumServerThread
from tests.integration.conftest import eventually

ROOT = Path(__file__).resolve().parents[2]
RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")
LONG = timedelta(seconds=20)


@pytest.fixture
async def raw(
    quorum_server: QuorumServer, token: str
) -> AsyncIterator[tuple[pb_grpc.QuorumServiceAsyncStub, tuple[tuple[str, str], ...]]]:
    channel = grpc.aio.insecure_channel(quorum_server.address)
    yield pb_grpc.QuorumServiceStub(channel), (("authorization", f"Bearer {token}"),)
    await channel.close()


def join_request(rid: str, world: int = 1, ftar: str = "127.0.0.1:1") -> pb.JoinRequest:
    endpoint = pb.RankEndpoint(ftar=ftar, checkpoint="http://127.0.0.1:2")
    return pb.JoinRequest(replica_id=rid, world_size=world, ranks=[endpoint] * max(world, 0))


async def code_of(call: Awaitable[object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code()


async def test_every_rpc_needs_the_token_but_health_does_not(
    quorum_server: QuorumServer, token: str
) -> None:
    async with grpc.aio.insecure_channel(quorum_server.address) as channel:
        stub = pb_grpc.QuorumServiceStub(channel)
        wrong = (("authorization", "Bearer " + "x" * 32),)
        assert await code_of(stub.Status(pb.StatusRequest())) == grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(stub.Join(join_request("a"), metadata=wrong)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        stream = stub.Watch(pb.WatchRequest(), metadata=wrong)
        assert await code_of(stream.read()) == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="fthsdp.v1.QuorumService"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with AsyncQuorumClient(quorum_server.address, "y" * 32) as intruder:
        with pytest.raises(AuthError):
            await intruder.join("a", [RANK])
    async with AsyncQuorumClient(quorum_server.address, token) as client:
        assert (await client.status()).members == ()  # the refused Join changed nothing


@pytest.mark.parametrize(
    "request_",
    [
        join_request(""),
        join_request("x" * 129),
        join_request("a", world=0),
        join_request("a", world=4097),
        join_request("a", ftar="no-port"),
        join_request("a", ftar="h:" + "9" * 260),
        pb.JoinRequest(
            replica_id="a", world_size=2, ranks=[pb.RankEndpoint(ftar="h:1", checkpoint="http://h")]
        ),
    ],
)
async def test_bad_join_is_invalid_argument_and_changes_nothing(
    raw: tuple[pb_grpc.QuorumServiceAsyncStub, tuple[tuple[str, str], ...]],
    request_: pb.JoinRequest,
) -> None:
    stub, auth = raw
    assert await code_of(stub.Join(request_, metadata=auth)) == grpc.StatusCode.INVALID_ARGUMENT
    status = await stub.Status(pb.StatusRequest(), metadata=auth)
    assert len(status.members) == 0


async def test_bad_quorum_requests_are_rejected_with_clear_codes(
    raw: tuple[pb_grpc.QuorumServiceAsyncStub, tuple[tuple[str, str], ...]],
) -> None:
    stub, auth = raw
    first = (await stub.Join(join_request("a"), metadata=auth)).incarnation
    second = (await stub.Join(join_request("a"), metadata=auth)).incarnation
    assert second > first
    negative = pb.QuorumRequest(replica_id="a", incarnation=second, step=-1)
    assert await code_of(stub.Quorum(negative, metadata=auth)) == grpc.StatusCode.INVALID_ARGUMENT
    stale = pb.QuorumRequest(replica_id="a", incarnation=first, step=0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Quorum(stale, metadata=auth)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale incarnation" in (info.value.details() or "")
    ghost = pb.HeartbeatRequest(replica_id="ghost", incarnation=1)
    assert (
        await code_of(stub.Heartbeat(ghost, metadata=auth)) == grpc.StatusCode.FAILED_PRECONDITION
    )
    mismatch = join_request("b", world=2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Join(mismatch, metadata=auth)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "same world size" in (info.value.details() or "")
    status = await stub.Status(pb.StatusRequest(), metadata=auth)
    assert [(m.replica_id, m.incarnation) for m in status.members] == [("a", second)]


async def test_client_raises_typed_errors(quorum_server: QuorumServer, token: str) -> None:
    async with AsyncQuorumClient(quorum_server.address, token) as client:
        old = await client.join("a", [RANK])
        new = await client.join("a", [RANK])
        with pytest.raises(StaleIncarnationError):
            await client.heartbeat("a", old)
        with pytest.raises(UnknownReplicaError):
            await client.quorum("zz", 1, 0, timeout=LONG)
        with pytest.raises(WorldSizeMismatchError):
            await client.join("b", [RANK, RANK])
        with pytest.raises(InvalidRequestError):
            await client.quorum("a", new, -3, timeout=LONG)
        await client.join("b", [RANK])
        started = time.monotonic()
        with pytest.raises(QuorumTimeoutError) as info:  # b is live and never asks
            await client.quorum("a", new, 0, timeout=timedelta(milliseconds=300))
        assert isinstance(info.value, TimeoutError)
        assert time.monotonic() - started < 2.0

        async def dropped() -> bool:
            return not any(m.waiting for m in (await client.status()).members)

        await eventually(dropped, seconds=5)  # the expired call does not linger in the round


async def test_unexpected_failure_is_internal_without_details(
    quorum_server: QuorumServer, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def explode(history_limit: int = 0) -> None:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(quorum_server.coordinator, "status", explode)
    async with AsyncQuorumClient(quorum_server.address, token) as client:
        with pytest.raises(InternalError) as info:
            await client.status()
    assert "secret" not in str(info.value)
    assert "Traceback" not in str(info.value)


async def test_an_answer_carries_only_what_the_caller_lacks_and_needs(
    raw: tuple[pb_grpc.QuorumServiceAsyncStub, tuple[tuple[str, str], ...]],
    quorum_server: QuorumServer,
    token: str,
) -> None:
    stub, auth = raw
    inc = (await stub.Join(join_request("a"), metadata=auth)).incarnation
    first = await stub.Quorum(
        pb.QuorumRequest(replica_id="a", incarnation=inc, step=0), metadata=auth
    )
    assert first.members_form == pb.MEMBERS_FORM_FULL
    assert [m.replica_id for m in first.members] == ["a"]
    assert first.endpoints[0].replica_id == "a"
    assert first.endpoints[0].ranks[0].ftar == "127.0.0.1:1"
    same = await stub.Quorum(
        pb.QuorumRequest(replica_id="a", incarnation=inc, step=1, known_quorum_id=first.quorum_id),
        metadata=auth,
    )
    assert same.quorum_id == first.quorum_id
    assert same.members_form == pb.MEMBERS_FORM_SAME
    assert len(same.members) == 0 and len(same.lagging) == 0 and len(same.endpoints) == 0
    assert same.ByteSize() < 128  # ids, step, form and the reason for the logs
    unknown = await stub.Quorum(  # a quorum id this server never answered: everything again
        pb.QuorumRequest(
            replica_id="a", incarnation=inc, step=2, known_quorum_id=first.quorum_id + 99
        ),
        metadata=auth,
    )
    assert unknown.members_form == pb.MEMBERS_FORM_FULL and unknown.endpoints[0].ranks
    async with AsyncQuorumClient(quorum_server.address, token) as client:
        inc_b = await client.join("b", [RANK])
        raw_answers: list[pb.QuorumResponse] = []
        for step in (3, 4):  # step 3: a new epoch with b; step 4: the same epoch again
            # b asks first: a newcomer that has not asked yet holds no round up.
            b = asyncio.ensure_future(client.quorum("b", inc_b, step, timeout=LONG))
            deadline = time.monotonic() + 10
            while not any(
                m.waiting for m in (await client.status()).members if m.replica_id == "b"
            ):
                assert time.monotonic() < deadline, "b's ask never reached the round"
                await asyncio.sleep(0.01)
            known = raw_answers[-1].quorum_id if raw_answers else first.quorum_id
            a = stub.Quorum(
                pb.QuorumRequest(replica_id="a", incarnation=inc, step=step, known_quorum_id=known),
                metadata=auth,
            )
            answer, quorum = await asyncio.gather(a, b)
            raw_answers.append(answer)
            assert quorum.member("b").ranks == (RANK,)
            assert quorum.member("a").ranks[0].ftar == "127.0.0.1:1"
        assert client._endpoints.known_quorum_id("b") == quorum.quorum_id
    changed, steady = raw_answers
    # A new membership: every member, with the endpoints of a's new neighbour b only (a held
    # its own, from the quorum of itself alone).
    assert changed.members_form == pb.MEMBERS_FORM_FULL
    assert [m.replica_id for m in changed.members] == ["a", "b"]
    assert [e.replica_id for e in changed.endpoints] == ["b"]
    assert steady.members_form == pb.MEMBERS_FORM_SAME and len(steady.members) == 0
    assert len(steady.endpoints) == 0


async def test_graceful_stop_releases_waiters_and_is_idempotent(
    make_quorum_server: Callable[..., Awaitable[QuorumServer]], token: str
) -> None:
    server = await make_quorum_server()
    admin = f"http://{server.admin_address}"
    scrape = urllib.request.Request(  # noqa: S310
        f"{admin}/metrics", headers={"authorization": f"Bearer {token}"}
    )
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(scrape).read()  # noqa: S310
    )
    assert b"fthsdp_quorum_joins_total" in body
    client = AsyncQuorumClient(server.address, token)
    channel = grpc.aio.insecure_channel(server.address)
    try:
        a = await client.join("a", [RANK])
        await client.join("b", [RANK])
        stub = pb_grpc.QuorumServiceStub(channel)
        waiting = stub.Quorum(
            pb.QuorumRequest(replica_id="a", incarnation=a, step=0),
            metadata=(("authorization", f"Bearer {token}"),),
            timeout=30,
        )

        async def a_waits() -> bool:
            return any(m.waiting for m in (await client.status()).members)

        await eventually(a_waits)
        started = time.monotonic()
        await asyncio.gather(server.stop(timedelta(seconds=5)), server.stop())
        assert time.monotonic() - started < 3.0  # the long poll did not hold the drain
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await waiting
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # retryable, not an error
        assert not server.is_serving()
        await server.stop()
        with pytest.raises(QuorumUnavailableError):  # retried with backoff, then given up
            await client.quorum("a", a, 0, timeout=timedelta(milliseconds=500))
    finally:
        await channel.close()
        await client.close()
    with pytest.raises(urllib.error.URLError):
        await asyncio.to_thread(lambda: urllib.request.urlopen(f"{admin}/readyz", timeout=2))  # noqa: S310


def test_sync_client_against_a_server_thread(quorum_thread: QuorumServerThread, token: str) -> None:
    with (
        QuorumClient(quorum_thread.address, token) as a,
        QuorumClient(quorum_thread.address, token) as b,
    ):
        inc_a = a.join("a", [RANK])
        inc_b = b.join("b", [RANK])
        stream = a.watch()
        assert next(stream).kind == "snapshot"
        results: dict[str, object] = {}
        worker = threading.Thread(
            target=lambda: results.update(b=b.quorum("b", inc_b, 0, timeout=LONG))
        )
        worker.start()
        quorum = a.quorum("a", inc_a, 0, timeout=LONG)
        worker.join(10)
        assert results["b"] == quorum
        assert [m.replica_id for m in quorum.members] == ["a", "b"]
        a.heartbeat("a", inc_a)
        assert next(stream).kind == "quorum"
        b.leave("b", inc_b, "done")
        event = next(stream)
        assert (event.kind, event.replica_id) == ("left", "b")
        status = a.status()
        assert [m.replica_id for m in status.members] == ["a"]
        assert status.quorums[-1].members == ("a", "b")
        # close() from another thread ends a blocked iteration
        blocked: list[object] = []
        reader = threading.Thread(target=lambda: blocked.extend(stream))
        reader.start()
        a.close()  # ends the iteration whether or not the reader already blocks in next()
        reader.join(10)
        assert not reader.is_alive()
        assert blocked == []


@pytest.mark.timeout(60)
def test_command_line_prints_its_address_and_drains_on_sigterm(token: str) -> None:
    env = {**os.environ, "FTHSDP_TOKEN": token, "FTHSDP_QUORUM_ADMIN_PORT": "0"}
    started_ms = time.time_ns() // 1_000_000
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fthsdp.services.quorum",
            "--port",
            "0",
            "--heartbeat-timeout-ms",
            "800",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
        assert match, line
        with QuorumClient(match.group(1), token) as client:
            status = client.status()
            assert status.members == ()
            # a fresh in-memory service starts its epochs above the wall clock (I3 on restart)
            assert status.quorum_id >= started_ms
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_command_line_refuses_to_start_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTHSDP_")}
    result = subprocess.run(
        [sys.executable, "-m", "fthsdp.services.quorum", "--port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "token" in result.stderr


async def test_a_membership_too_large_to_answer_is_refused_at_join(
    make_quorum_server: Callable[..., Awaitable[QuorumServer]], token: str
) -> None:
    """Replicas of 4,096 ranks with 256-character addresses are each within every per-field
    limit, yet 36 of them made every Quorum and Status answer exceed the 64 MiB message cap (the
    round formed, and nobody learned it). Join now refuses the replica that would overflow, and
    the answers for the admitted ones still arrive."""
    host = "h" * (256 - len(":29500"))
    ranks = [
        RankEndpoint(ftar=f"{host}:29500", checkpoint="http://" + "c" * 249) for _ in range(4096)
    ]
    # Members that never beat stay registered for the whole test.
    quorum_server = await make_quorum_server(heartbeat_timeout=timedelta(minutes=5))
    async with AsyncQuorumClient(quorum_server.address, token) as client:
        refused: list[MembershipTooLargeError] = []
        admitted = 0
        while admitted < 36 and not refused:
            try:
                await client.join(f"r{admitted:02d}", ranks)
                admitted += 1
            except MembershipTooLargeError as exc:
                refused.append(exc)
        assert 20 <= admitted < 36, admitted
        assert "one answer can carry" in str(refused[0])
        status = await client.status()
        assert len(status.members) == admitted
        # A rejoin of an admitted replica (its endpoints replace its own) is still allowed.
        await client.join("r00", ranks)
