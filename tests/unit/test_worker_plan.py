"""The leader's quorum broadcast and each rank's view of it."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from fthsdp.services.quorum.client import Member, MicroSteps, Quorum, RankEndpoint
from fthsdp.worker.plan import (
    NoQuorumError,
    decode_plan,
    encode_failure,
    encode_quorum,
    encode_steady,
    fallback_payload,
    steady_max_step,
)


def _member(replica: str, step: int) -> Member:
    ranks = tuple(
        RankEndpoint(ftar=f"{replica}-ftar-{r}:1", checkpoint=f"http://{replica}-ckpt")
        for r in range(2)
    )
    return Member(replica_id=replica, incarnation=1, step=step, ranks=ranks)


QUORUM = Quorum(
    quorum_id=7,
    members=(_member("r0", 5), _member("r1", 2), _member("r2", 5)),
    max_step=5,
    healthy=("r0", "r2"),
    sources={"r1": (("r0", "r2"), ("r2", "r0"))},
)


def test_each_rank_gets_its_own_ring_and_sources() -> None:
    for rank in range(2):
        plan = decode_plan(encode_quorum(QUORUM, "r1"), replica_id="r1", rank=rank)
        assert plan.ring == tuple(f"r{i}-ftar-{rank}:1" for i in range(3))
        assert plan.ring_replicas == ("r0", "r1", "r2")
        assert plan.num_healthy == 2 and not plan.serve
    second = decode_plan(encode_quorum(QUORUM, "r1"), replica_id="r1", rank=1)
    assert [s.replica_id for s in second.sources] == ["r2", "r0"]  # rank 1 starts elsewhere
    assert second.sources[0].url == "http://r2-ckpt"


def test_a_rank_of_a_large_ring_knows_its_neighbours_and_sources_only() -> None:
    """What the quorum service sends (`Quorum.needed_by`): every member, the endpoints of a
    few. The plan leaves the others' addresses empty, which the ring accepts for the members
    it never connects to."""
    members = tuple(_member(f"r{i}", 2 if i == 3 else 5) for i in range(8))
    full = Quorum(
        quorum_id=9,
        members=members,
        max_step=5,
        healthy=tuple(m.replica_id for m in members if m.step == 5),
        sources={"r3": (("r5", "r6"), ("r6", "r7"))},
    )
    needed = set(full.needed_by("r3"))
    assert needed == {"r2", "r3", "r4", "r5", "r6", "r7"}
    received = replace(
        full,
        members=tuple(m if m.replica_id in needed else replace(m, ranks=()) for m in members),
    )
    plan = decode_plan(encode_quorum(received, "r3"), replica_id="r3", rank=1)
    # Its sources' addresses came with their endpoints; r0 and r1 it knows nothing of.
    assert plan.ring == ("", "", *(f"r{i}-ftar-1:1" for i in range(2, 8)))
    assert plan.ring_replicas == tuple(f"r{i}" for i in range(8))
    assert [s.url for s in plan.sources] == ["http://r6-ckpt", "http://r7-ckpt"]
    # Without a neighbour's endpoints there is no ring to join: refused, not joined with a hole.
    holed = replace(
        received,
        members=tuple(
            replace(m, ranks=()) if m.replica_id == "r4" else m for m in received.members
        ),
    )
    with pytest.raises(ValueError, match="neighbours"):
        decode_plan(encode_quorum(holed, "r3"), replica_id="r3", rank=0)


def test_a_healthy_source_knows_it_serves_and_fetches_nothing() -> None:
    plan = decode_plan(encode_quorum(QUORUM, "r0"), replica_id="r0", rank=0)
    assert plan.serve and plan.sources == ()


def test_a_leader_without_quorum_stops_every_rank() -> None:
    with pytest.raises(NoQuorumError, match="no quorum within"):
        decode_plan(encode_failure("no quorum within quorum_timeout"), replica_id="r0", rank=0)


@pytest.mark.parametrize(
    "payload", [b"[]", b'{"members": 3}', b'{"quorum_id": 1}', b"{}", b'{"members": [{}]}']
)
def test_malformed_plans_are_value_errors(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_plan(payload, replica_id="r0", rank=0)


def test_a_plan_that_leaves_this_replica_out_is_refused() -> None:
    with pytest.raises(ValueError, match="include this replica"):
        decode_plan(encode_quorum(QUORUM, "r1"), replica_id="r9", rank=0)


def test_only_a_moved_step_is_a_steady_plan() -> None:
    """The leader sends just max_step when nothing else changed; anything else goes in full."""
    from dataclasses import replace

    before = encode_quorum(QUORUM, "r0")
    assert steady_max_step(None, before) is None
    assert steady_max_step(before, encode_quorum(replace(QUORUM, max_step=6), "r0")) == 6
    assert steady_max_step(before, encode_quorum(replace(QUORUM, quorum_id=8), "r0")) is None
    assert steady_max_step(before, encode_quorum(replace(QUORUM, healthy=("r0",)), "r0")) is None
    assert steady_max_step(before, encode_quorum(QUORUM, "r1")) is None  # other sources
    assert steady_max_step(before, encode_failure("gone")) is None
    assert steady_max_step(encode_failure("gone"), before) is None
    assert steady_max_step(before, encode_quorum(replace(QUORUM, max_step=50), "r0")) == 50
    odd = replace(QUORUM, healthy=('max_step":1', "r2"))  # a key-like id stays escaped
    assert steady_max_step(encode_quorum(odd, "r0"), encode_quorum(odd, "r0")) == 5


def test_a_steady_quorum_is_restamped_exactly_as_it_would_be_encoded() -> None:
    from dataclasses import replace

    steady = replace(STEADY_BASE, max_step=6)
    first = encode_quorum(STEADY_BASE, "r0")
    again = encode_steady((STEADY_BASE, first), steady, "r0")
    assert again == encode_quorum(steady, "r0")
    # Anything more than the step goes through the encoder.
    for changed in (
        replace(steady, quorum_id=10),
        replace(steady, healthy=("r0",)),
        replace(QUORUM, max_step=6),
    ):
        assert encode_steady((STEADY_BASE, first), changed, "r0") == encode_quorum(changed, "r0")
    assert encode_steady(None, steady, "r0") == encode_quorum(steady, "r0")


STEADY_BASE = Quorum(
    quorum_id=9,
    members=(_member("r0", 5), _member("r1", 5)),
    max_step=5,
    healthy=("r0", "r1"),
    sources={},
)


STEADY = Quorum(
    quorum_id=9,
    members=(_member("r0", 5), _member("r1", 5)),
    max_step=5,
    healthy=("r0", "r1"),
    sources={},
)


def test_a_steady_replica_may_go_on_without_the_service_on_the_same_ring() -> None:
    sent = encode_quorum(STEADY, "r0")
    plan = decode_plan(sent, replica_id="r0", rank=0)
    payload = fallback_payload(plan, sent, 6)
    assert payload is not None
    fallback = decode_plan(payload, replica_id="r0", rank=1)
    assert fallback.fallback and fallback.max_step == 6
    assert (fallback.quorum_id, fallback.ring, fallback.healthy) == (
        9,
        decode_plan(sent, replica_id="r0", rank=1).ring,
        ("r0", "r1"),
    )  # no epoch or membership is made up locally (I3)


def test_no_fallback_outside_the_steady_state() -> None:
    sent = encode_quorum(STEADY, "r0")
    plan = decode_plan(sent, replica_id="r0", rank=0)
    assert fallback_payload(None, sent, 6) is None  # no plan yet
    assert fallback_payload(plan, None, 6) is None
    assert fallback_payload(plan, sent, 5) is None  # the last step did not commit
    assert fallback_payload(plan, sent, 7) is None
    recovering = encode_quorum(QUORUM, "r0")  # r1 recovers from r0 and r2 (they serve)
    for replica in ("r0", "r1"):
        mixed = decode_plan(recovering, replica_id=replica, rank=0)
        assert fallback_payload(mixed, recovering, 6) is None


UNEVEN = MicroSteps(
    even=4,
    trained=MappingProxyType({"r1": 2}),
    next=MappingProxyType({"r0": 5, "r1": 3}),
)


def test_every_rank_learns_each_members_micro_steps_and_the_gradient_scale() -> None:
    from dataclasses import replace

    quorum = replace(STEADY, micro_steps=UNEVEN)
    plan = decode_plan(encode_quorum(quorum, "r1"), replica_id="r1", rank=1)
    assert plan.micro_steps == UNEVEN
    assert (plan.micro_steps.trained_by("r0"), plan.micro_steps.trained_by("r1")) == (4, 2)
    assert plan.micro_steps.next_for("r1") == 3
    assert plan.total_micro_steps == 6
    # The ring sums and divides by 2 healthy replicas: 2/6 makes it the sum over 6 micro-steps.
    assert plan.gradient_scale() == pytest.approx(2 / 6)
    # One micro-step each (the default) leaves the average alone.
    assert decode_plan(encode_quorum(STEADY, "r1"), replica_id="r1", rank=0).gradient_scale() == 1
    # A new plan is a change the steady path must not hide.
    assert encode_steady((STEADY, encode_quorum(STEADY, "r0")), quorum, "r0") == encode_quorum(
        quorum, "r0"
    )


def test_without_the_service_every_member_trains_what_the_last_answer_planned() -> None:
    from dataclasses import replace

    sent = encode_quorum(replace(STEADY, micro_steps=UNEVEN), "r0")
    plan = decode_plan(sent, replica_id="r0", rank=0)
    payload = fallback_payload(plan, sent, 6)
    assert payload is not None
    fallback = decode_plan(payload, replica_id="r0", rank=0)
    assert dict(fallback.micro_steps.trained) == {"r0": 5, "r1": 3}
    assert fallback.total_micro_steps == 8


@pytest.mark.parametrize(
    "micro",
    [
        {"even": 0, "trained": {}, "next": {}},
        {"even": 2, "trained": {"r0": -1}, "next": {}},
        {"even": 2, "trained": [], "next": {}},
    ],
)
def test_malformed_micro_steps_are_value_errors(micro: object) -> None:
    import json

    body = json.loads(encode_quorum(STEADY, "r0"))
    body["micro_steps"] = micro
    with pytest.raises(ValueError):
        decode_plan(json.dumps(body).encode(), replica_id="r0", rank=0)
