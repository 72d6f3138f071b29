"""How an agent reads a failed forward (`forward_pacing.reached_busy_central`), on real gRPC: a
central that holds the call past its deadline is busy (back off long); no listener, a wrong
token or a stopped central is not (retry within a few seconds)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import grpc
import pytest

from fthsdp.protos import health_pb2 as pb
from fthsdp.protos import health_pb2_grpc as pb_grpc
from fthsdp.services.common.tokens import Token
from fthsdp.services.health.forward_pacing import CHANNEL_OPTIONS, reached_busy_central
from fthsdp.services.health.server import IngestServer
from tests.ingest_support import RecordingSink, ingest_server


@pytest.fixture
async def held(token: str) -> AsyncIterator[tuple[RecordingSink, IngestServer]]:
    """A central whose every Report is held until the test ends."""
    async with ingest_server(token) as (sink, server):
        sink.gate.clear()
        yield sink, server


async def _forward(address: str, token: str, timeout_s: float = 0.3) -> tuple[grpc.RpcError, bool]:
    """One node-state Report like an agent's; the failure and `reached_busy_central` for it."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub: object = pb_grpc.HealthServiceStub(channel)
        request = pb.ReportRequest(source="agent:n0", host="n0")
        try:
            await stub.Report(  # type: ignore[attr-defined]
                request, timeout=timeout_s, metadata=(("authorization", Token(token).header()),)
            )
        except grpc.RpcError as err:
            return err, reached_busy_central(err, channel)
    raise AssertionError("the forward went through")


async def test_a_central_holding_the_forward_past_its_deadline_is_busy(
    held: tuple[RecordingSink, IngestServer], token: str
) -> None:
    sink, server = held
    err, busy = await _forward(server.address, token)
    assert sink.entered == 1  # it reached the handler, which held it
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert busy


async def test_nothing_listening_is_unreachable_not_busy(token: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        err, busy = await _forward(f"127.0.0.1:{port}", token, timeout_s=1.0)
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert not busy


async def test_a_wrong_token_is_not_busy(held: tuple[RecordingSink, IngestServer]) -> None:
    sink, server = held
    err, busy = await _forward(server.address, "w" * 32)
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not busy and sink.entered == 0


async def test_a_stopped_central_is_not_busy(
    held: tuple[RecordingSink, IngestServer], token: str
) -> None:
    sink, server = held
    sink.gate.set()
    await server.stop()
    err, busy = await _forward(server.address, token, timeout_s=1.0)
    assert isinstance(err, grpc.aio.AioRpcError)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert not busy
