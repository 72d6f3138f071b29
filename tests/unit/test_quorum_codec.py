"""Wire mapping: a quorum survives encode/decode, each caller gets the endpoints it needs and no
others (a steady answer is O(1) bytes, a new membership O(replicas) small entries), errors map
back."""

from __future__ import annotations

from dataclasses import replace
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
    SOURCES_PER_RANK,
    AuthError,
    InternalError,
    Member,
    MicroSteps,
    Quorum,
    QuorumTimeoutError,
    QuorumUnavailableError,
    RankEndpoint,
    StaleIncarnationError,
    StepWork,
    UnknownReplicaError,
)
from fthsdp.services.quorum.errors import NotLeaderError
from fthsdp.services.quorum.server import status_for
from tests.unit.quorum_answer_support import answer


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


def _wire(
    quorum: Quorum, form: codec.MembersForm = codec.FULL, caller: str = "a"
) -> pb.QuorumResponse:
    """The answer as `caller` receives it: the shared part, then its endpoints (encoded, then
    parsed)."""
    # A SAME answer's caller holds its ring in this quorum already (see services/quorum/answers).
    return answer(quorum, caller, form, quorum.ring_of(caller) if form == codec.SAME else ())


def _stripped(quorum: Quorum) -> Quorum:
    return replace(quorum, members=tuple(replace(m, ranks=()) for m in quorum.members))


def _as_received(msg: pb.QuorumResponse, known: Quorum | None = None) -> Quorum:
    return codec.with_endpoints(codec.quorum_from_pb(msg, known), codec.endpoints_from_pb(msg))


def test_quorum_round_trips_with_the_endpoints_its_caller_needs() -> None:
    quorum = _quorum()
    # c recovers (sources a, b, d) and sits between b and d in the ring.
    msg = _wire(quorum, caller="c")
    assert codec.quorum_from_pb(msg, None) == _stripped(quorum)
    decoded = _as_received(msg)
    assert [m.replica_id for m in decoded.members if m.ranks] == ["a", "b", "c", "d"]
    assert decoded.member("c").ranks == quorum.member("c").ranks
    assert decoded.member("a").ranks[2].ftar == "a:9002"
    assert decoded.member("e").ranks == ()
    assert decoded.is_healthy("d")
    assert not decoded.is_healthy("e")
    assert decoded.num_healthy == 3
    assert decoded.recovering == ("c", "e")
    assert decoded.sources == quorum.sources
    with pytest.raises(KeyError):
        decoded.member("zz")


def test_each_caller_gets_the_endpoints_of_itself_and_its_ring_neighbours_only() -> None:
    quorum = _quorum()
    # The ring is a b c d e: a's neighbours are e (wrapping around) and b.
    assert [e.replica_id for e in _wire(quorum, caller="a").endpoints] == ["a", "b", "e"]
    assert [e.replica_id for e in _wire(quorum, caller="b").endpoints] == ["a", "b", "c"]
    # Every caller of a round shares everything but its endpoints.
    assert codec.quorum_from_pb(_wire(quorum, caller="a"), None) == codec.quorum_from_pb(
        _wire(quorum, caller="d"), None
    )
    pair = replace(quorum, members=quorum.members[:2], healthy=("a", "b"), sources={})
    assert [e.replica_id for e in _wire(pair, caller="a").endpoints] == ["a", "b"]
    # What the caller holds already stays out.
    assert [e.replica_id for e in answer(quorum, "a", codec.FULL, ("a", "e")).endpoints] == ["b"]
    alone = replace(pair, members=pair.members[:1], healthy=("a",))
    assert [e.replica_id for e in _wire(alone, caller="a").endpoints] == ["a"]


def test_a_recovering_rank_fetches_from_a_few_sources_and_gets_their_endpoints_only() -> None:
    members = tuple(
        Member(
            replica_id=f"r{i:02d}", incarnation=1, step=0 if i == 5 else 9, ranks=_ranks(f"h{i}", 2)
        )
        for i in range(12)
    )
    healthy = tuple(m.replica_id for m in members if m.step == 9)
    quorum = Quorum(
        quorum_id=4,
        members=members,
        max_step=9,
        healthy=healthy,
        sources=MappingProxyType(assign_sources(healthy, [("r05", 2)])),
    )
    decoded = _as_received(_wire(quorum, caller="r05"))
    per_rank = decoded.sources["r05"]
    assert [len(s) for s in per_rank] == [SOURCES_PER_RANK, SOURCES_PER_RANK]
    assert per_rank[0][0] != per_rank[1][0]  # the ranks start at different sources
    wanted = {"r04", "r05", "r06"} | {rid for s in per_rank for rid in s}
    assert {m.replica_id for m in decoded.members if m.ranks} == wanted
    assert len(wanted) < len(members)
    # A steady answer to the recovering replica carries its sources' endpoints again (they
    # follow the healthy set, which may grow within a quorum); to a healthy one, none.
    same = _wire(quorum, codec.SAME, caller="r05")
    sources = {rid for s in per_rank for rid in s}
    assert {e.replica_id for e in same.endpoints} == sources - {"r04", "r06"}  # its ring's held
    assert not _wire(quorum, codec.SAME, caller="r00").endpoints


def test_same_quorum_sends_only_the_lagging_members_and_restores_the_rest() -> None:
    quorum = _quorum()
    msg = _wire(quorum, codec.SAME)
    assert len(msg.members) == 0
    assert [(m.replica_id, m.step) for m in msg.lagging] == [("c", 4), ("e", 0)]
    # The caller held the same quorum at an earlier step, everyone at 8: steps come from the wire.
    earlier = replace(
        quorum,
        members=tuple(replace(m, step=8) for m in quorum.members),
        max_step=8,
        healthy=("a", "b", "c", "d", "e"),
        sources=MappingProxyType({}),
    )
    assert codec.quorum_from_pb(msg, earlier) == _stripped(quorum)
    with pytest.raises(KeyError):  # the caller holds another quorum id: it must ask again
        codec.quorum_from_pb(msg, replace(earlier, quorum_id=11))
    with pytest.raises(KeyError):
        codec.quorum_from_pb(msg, None)


def test_no_answer_grows_with_replicas_times_ranks() -> None:
    members = tuple(
        Member(replica_id=f"replica-{i:04d}", incarnation=i + 1, step=7, ranks=_ranks(f"h{i}", 64))
        for i in range(1536)
    )
    big = Quorum(
        quorum_id=3, members=members, max_step=7, healthy=tuple(m.replica_id for m in members)
    )
    assert len(_wire(big, codec.SAME, caller="replica-0007").SerializeToString()) < 32
    # A new membership lists every member, with the endpoints of three: tens of kilobytes, where
    # every member's endpoints would be 4.4 MB for each caller.
    full = _wire(big, caller="replica-0007").SerializeToString()
    assert len(full) < 80_000
    assert len(codec.quorum_to_pb(big).SerializeToString()) < 50_000


def test_endpoints_of_another_incarnation_or_a_non_member_are_not_taken() -> None:
    quorum = _quorum()
    msg = _wire(quorum, caller="a")
    held = codec.endpoints_from_pb(msg)
    held["b"] = (99, _ranks("old", 3))
    held["zz"] = (1, _ranks("zz", 3))
    decoded = codec.with_endpoints(codec.quorum_from_pb(msg, None), held)
    assert decoded.member("b").ranks == ()
    assert decoded.member("a").ranks == quorum.member("a").ranks
    twice = _wire(quorum, caller="a")
    twice.endpoints.add(replica_id="a", incarnation=1)
    with pytest.raises(InternalError):
        codec.endpoints_from_pb(twice)


def test_lagging_names_outside_the_quorum_are_refused() -> None:
    quorum = _quorum()
    msg = _wire(quorum, codec.SAME)
    msg.lagging.add(replica_id="zz", step=1)
    with pytest.raises(InternalError):
        codec.quorum_from_pb(msg, quorum)


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


def test_micro_step_shares_travel_in_every_form_and_stay_small() -> None:
    micro = MicroSteps(
        even=4, trained=MappingProxyType({"b": 2}), next=MappingProxyType({"a": 6, "b": 2})
    )
    quorum = replace(_quorum(), micro_steps=micro)
    for form in (codec.FULL, codec.SAME):
        decoded = codec.quorum_from_pb(_wire(quorum, form), quorum)
        assert decoded.micro_steps == micro
        assert decoded.micro_steps.total(decoded.healthy) == 4 + 2 + 4
    # An even split is one small number, whatever the share and the number of members.
    even = replace(_quorum(), micro_steps=MicroSteps(even=4))
    plain = len(codec.quorum_to_pb(_quorum(), form=codec.SAME).SerializeToString())
    assert len(codec.quorum_to_pb(even, form=codec.SAME).SerializeToString()) == plain
    # An older service sends no shares at all: one micro-step each.
    assert codec.quorum_from_pb(_wire(_quorum()), None).micro_steps == MicroSteps()


def test_step_work_round_trips_and_out_of_range_values_are_refused() -> None:
    work = StepWork(micro_steps=0, even=4, max_micro_steps=8, busy_seconds=0.5, busy_micro_steps=3)
    request = pb.QuorumRequest(replica_id="a", incarnation=1, step=3)
    codec.work_to_pb(request, work)
    assert codec.work_from_pb(pb.QuorumRequest.FromString(request.SerializeToString())) == work
    assert codec.work_from_pb(pb.QuorumRequest()) == StepWork()  # an older client: the defaults
    for bad in (
        {"micro_steps": 5000},
        {"even_micro_steps": 4097},
        {"busy_seconds": float("nan")},
        {"busy_seconds": -1.0},
    ):
        with pytest.raises(ValueError):
            codec.work_from_pb(pb.QuorumRequest(**bad))  # type: ignore[arg-type]
