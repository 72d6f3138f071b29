"""Wire mapping: a quorum survives encode/decode, endpoints can be left out, errors map back."""

from __future__ import annotations

from datetime import timedelta
from types import MappingProxyType

import grpc
import pytest

from fthsdp.protos import quorum_pb2 as pb
from fthsdp.services.common.errors import AuthError as CommonAuthError
from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.__main__ import build_parser, resolve_config
from fthsdp.services.quorum.config import QuorumConfig
from fthsdp.services.quorum.core import assign_sources
from fthsdp.services.quorum.domain import (
    ERROR_WIRE,
    AuthError,
    InternalError,
    Member,
    Quorum,
    QuorumTimeoutError,
    QuorumUnavailableError,
    RankEndpoint,
    StaleIncarnationError,
    UnknownReplicaError,
)
from fthsdp.services.quorum.errors import NotLeaderError
from fthsdp.services.quorum.server import status_for


def _ranks(host: str, n: int) -> tuple[RankEndpoint, ...]:
    return tuple(
        RankEndpoint(ftar=f"{host}:{9000 + i}", checkpoint=f"http://{host}:80{i}") for i in range(n)
    )


def _quorum() -> Quorum:
    members = tuple(
        Member(replica_id=rid, incarnation=i + 1, step=step, ranks=_ranks(rid, 3))
        for i, (rid, step) in enumerate([("a", 9), ("b", 9), ("c", 4), ("d", 9), ("e", 0)])
    )
    healthy = ("a", "b", "d")
    return Quorum(
        quorum_id=12,
        members=members,
        max_step=9,
        healthy=healthy,
        sources=MappingProxyType(assign_sources(healthy, [("c", 3), ("e", 3)])),
        reason="fast path",
    )


def test_quorum_round_trips_with_endpoints() -> None:
    quorum = _quorum()
    msg = pb.QuorumResponse.FromString(
        codec.quorum_to_pb(quorum, endpoints=True).SerializeToString()
    )
    decoded = codec.quorum_from_pb(msg, None)
    assert decoded == quorum
    assert decoded.member("c").ranks[2].ftar == "c:9002"
    assert decoded.is_healthy("d")
    assert not decoded.is_healthy("e")
    assert decoded.num_healthy == 3
    assert decoded.recovering == ("c", "e")
    with pytest.raises(KeyError):
        decoded.member("zz")


def test_endpoints_are_left_out_and_restored_from_the_cache() -> None:
    quorum = _quorum()
    full = codec.quorum_to_pb(quorum, endpoints=True).SerializeToString()
    lean = codec.quorum_to_pb(quorum, endpoints=False).SerializeToString()
    assert len(lean) < len(full) / 2
    msg = pb.QuorumResponse.FromString(lean)
    assert not msg.endpoints_included
    assert all(len(m.ranks) == 0 for m in msg.members)
    known = {m.replica_id: m.ranks for m in quorum.members}
    assert codec.quorum_from_pb(msg, known) == quorum


def test_errors_map_by_code_then_by_status() -> None:
    for exc in (UnknownReplicaError("x"), StaleIncarnationError("y"), NotLeaderError("z")):
        status, code, message = status_for(exc)
        assert status == exc.grpc_status
        decoded = ERROR_WIRE.from_grpc(status, message, code)
        # A standby's refusal is a server-only class: clients see what its status says.
        expected = QuorumUnavailableError if isinstance(exc, NotLeaderError) else type(exc)
        assert type(decoded) is expected
    assert status_for(StaleIncarnationError("y"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    unauthenticated = ERROR_WIRE.from_grpc(grpc.StatusCode.UNAUTHENTICATED, "", None)
    assert isinstance(unauthenticated, AuthError) and isinstance(unauthenticated, CommonAuthError)
    timeout = ERROR_WIRE.from_grpc(grpc.StatusCode.DEADLINE_EXCEEDED, "late", None)
    assert isinstance(timeout, QuorumTimeoutError)
    assert isinstance(timeout, TimeoutError)
    assert isinstance(ERROR_WIRE.from_grpc(grpc.StatusCode.DATA_LOSS, "", None), InternalError)
    # A server stopping with the call in flight cancels it: retried like a refusal, never an
    # answer (a replica leader that took it as one would stop its replica).
    cancelled = ERROR_WIRE.from_grpc(grpc.StatusCode.CANCELLED, "", None)
    assert isinstance(cancelled, QuorumUnavailableError)
    status, _, message = status_for(RuntimeError("secret detail"))
    assert status == grpc.StatusCode.INTERNAL
    assert "secret" not in message


def test_flags_beat_env_beat_defaults() -> None:
    parser = build_parser()
    env = {"FTHSDP_QUORUM_PORT": "9999", "FTHSDP_QUORUM_JOIN_TIMEOUT_MS": "750"}
    config = resolve_config(parser.parse_args(["--port", "1234", "--admin-port", "-1"]), env)
    assert config.port == 1234  # flag over env
    assert config.join_timeout == timedelta(milliseconds=750)  # env over default
    assert config.heartbeat_timeout == QuorumConfig().heartbeat_timeout  # default
    assert config.admin_port is None
    assert config.host == "127.0.0.1"
    with pytest.raises(ValueError, match="FTHSDP_QUORUM_MIN_REPLICAS"):
        resolve_config(parser.parse_args([]), {"FTHSDP_QUORUM_MIN_REPLICAS": "two"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_replicas": 0},
        {"port": 70000},
        {"admin_port": -1},
        {"join_timeout": timedelta(0)},
        {"heartbeat_timeout": timedelta(milliseconds=-1)},
        {"history_size": 0},
        {"host": ""},
    ],
)
def test_config_rejects_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must"):
        QuorumConfig(**kwargs)  # type: ignore[arg-type]
