"""Source assignment for recovering replicas: a few sources per rank, spread across ranks,
balanced."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from fthsdp.services.quorum.core import assign_sources
from fthsdp.services.quorum.domain import SOURCES_PER_RANK


@settings(max_examples=300, deadline=None)
@given(
    healthy=st.lists(
        st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=12, unique=True
    ),
    worlds=st.lists(st.integers(min_value=1, max_value=9), min_size=0, max_size=8),
)
def test_assignment_is_complete_spread_and_balanced(healthy: list[str], worlds: list[int]) -> None:
    pool = tuple(sorted(healthy))
    recovering = [(f"rec{i}", w) for i, w in enumerate(worlds)]
    sources = assign_sources(pool, recovering)

    assert set(sources) == {rid for rid, _ in recovering}
    primaries: Counter[str] = Counter()
    for rid, world in recovering:
        per_rank = sources[rid]
        assert len(per_rank) == world
        for order in per_rank:
            # a few distinct healthy replicas, in pool order from the first (a rotation)
            assert len(order) == min(SOURCES_PER_RANK, len(pool)) == len(set(order))
            start = pool.index(order[0])
            assert order == tuple(pool[(start + k) % len(pool)] for k in range(len(order)))
        firsts = [order[0] for order in per_rank]
        if len(pool) >= 2 and world >= 2:
            # ranks of one replica start at different sources, as far as there are sources
            assert len(set(firsts)) == min(world, len(pool))
        primaries.update(firsts)
    total = sum(worlds)
    if total:
        assert max(primaries.values()) <= math.ceil(total / len(pool))


def test_single_healthy_replica_serves_everything() -> None:
    sources = assign_sources(("a",), [("x", 3)])
    assert sources == {"x": (("a",), ("a",), ("a",))}


def test_no_healthy_replica_means_no_assignment() -> None:
    assert assign_sources((), [("x", 2)]) == {}
