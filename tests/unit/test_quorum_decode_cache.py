"""QuorumDecodeCache: each caller ends up with exactly the endpoints it needs, built up from
answers that carry only what it lacks, and asks again in full when an answer assumes more."""

from __future__ import annotations

from types import MappingProxyType

from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.client import QuorumDecodeCache
from fthsdp.services.quorum.core import assign_sources
from fthsdp.services.quorum.domain import Member, Quorum, RankEndpoint
from tests.unit.quorum_answer_support import answer


def _ranks(rid: str, world: int = 1) -> tuple[RankEndpoint, ...]:
    return tuple(
        RankEndpoint(ftar=f"{rid}:{r}", checkpoint=f"http://{rid}:2") for r in range(world)
    )


def _quorum(quorum_id: int, steps: dict[str, int], world: int = 1) -> Quorum:
    """Members at `steps`, each of `world` ranks; those below the top step recover from sources
    assigned as the service does."""
    top = max(steps.values())
    healthy = tuple(rid for rid, step in sorted(steps.items()) if step == top)
    recovering = [(rid, world) for rid, step in sorted(steps.items()) if step < top]
    return Quorum(
        quorum_id=quorum_id,
        members=tuple(
            Member(replica_id=rid, incarnation=1, step=step, ranks=_ranks(rid, world))
            for rid, step in sorted(steps.items())
        ),
        max_step=top,
        healthy=healthy,
        sources=MappingProxyType(assign_sources(healthy, recovering)),
    )


def _with_endpoints(quorum: Quorum) -> list[str]:
    return [m.replica_id for m in quorum.members if m.ranks]


def test_callers_sharing_a_cache_each_hold_their_own_neighbourhood() -> None:
    cache = QuorumDecodeCache()
    quorum = _quorum(5, {r: 3 for r in "abcde"})
    for caller in "ac":
        decoded = cache.decode(answer(quorum, caller, codec.FULL, set()), caller)
        assert decoded is not None
        assert _with_endpoints(decoded) == {"a": ["a", "b", "e"], "c": ["b", "c", "d"]}[caller]
        assert cache.known_quorum_id(caller) == 5
    assert cache.known_quorum_id("b") == 0  # it never asked
    steady = cache.decode(answer(quorum, "a", codec.SAME, set(quorum.ring_of("a"))), "a")
    assert steady is not None and _with_endpoints(steady) == ["a", "b", "e"]


def test_a_membership_change_completes_what_the_caller_held() -> None:
    cache = QuorumDecodeCache()
    first = _quorum(5, {r: 3 for r in "abcd"})
    assert cache.decode(answer(first, "a", codec.FULL, set()), "a") is not None
    # d left: a's ring is now c a b; it holds a and b, and is sent c only.
    second = _quorum(6, {r: 4 for r in "abc"})
    msg = answer(second, "a", codec.FULL, {"a", "b"})
    assert [e.replica_id for e in msg.endpoints] == ["c"]
    decoded = cache.decode(msg, "a")
    assert decoded is not None and _with_endpoints(decoded) == ["a", "b", "c"]
    assert decoded.member("c").ranks == _ranks("c")


def test_an_answer_that_assumes_endpoints_the_caller_lacks_is_asked_again() -> None:
    cache = QuorumDecodeCache()
    # d (2 ranks) and f recover; d's ranks fetch from a b c e and b c e a.
    first = _quorum(7, {"a": 9, "b": 9, "c": 9, "d": 0, "e": 9, "f": 0}, world=2)
    decoded = cache.decode(answer(first, "d", codec.FULL, set()), "d")
    assert decoded is not None and _with_endpoints(decoded) == ["a", "b", "c", "d", "e"]
    # f caught up within the same quorum: d's second rank now starts at b and reaches f.
    moved = _quorum(7, {"a": 9, "b": 9, "c": 9, "d": 0, "e": 9, "f": 9}, world=2)
    assert moved.sources["d"][1] == ("b", "c", "e", "f")
    # What the service sends (all but the ring and what the round before sent) decodes...
    sent = answer(moved, "d", codec.SAME, set(first.needed_by("d")))
    assert [e.replica_id for e in sent.endpoints] == ["f"]
    # ...but an answer assuming d held f already cannot be completed: asked again.
    lacking = answer(moved, "d", codec.SAME, set(moved.needed_by("d")))
    assert QuorumDecodeCache().decode(lacking, "d") is None
    assert cache.decode(lacking, "d") is None
    again = cache.decode(sent, "d")
    assert again is not None and _with_endpoints(again) == ["a", "b", "c", "d", "e", "f"]


def test_a_steady_answer_before_any_full_one_is_asked_again() -> None:
    quorum = _quorum(5, {r: 3 for r in "abc"})
    msg = answer(quorum, "a", codec.SAME, set(quorum.ring_of("a")))
    assert QuorumDecodeCache().decode(msg, "a") is None
