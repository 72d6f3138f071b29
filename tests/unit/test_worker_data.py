"""Exactly-once data (I2), unit level: shards are disjoint; positions move only on commit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fthsdp.worker.data import DataPositions, ShardSpec


@given(
    total=st.integers(1, 6),
    world=st.integers(1, 4),
    micro=st.integers(1, 5),
    steps=st.integers(1, 6),
)
def test_every_sample_id_is_owned_by_exactly_one_rank_and_step(
    total: int, world: int, micro: int, steps: int
) -> None:
    seen: dict[int, tuple[int, int, int]] = {}
    for replica in range(total):
        for rank in range(world):
            spec = ShardSpec(
                replica_index=replica,
                total_replicas=total,
                rank=rank,
                world_size=world,
                micro_batch=micro,
            )
            for step in range(steps):
                for sample in spec.sample_ids(step * spec.samples_per_step):
                    assert sample not in seen, (sample, seen[sample], (replica, rank, step))
                    seen[sample] = (replica, rank, step)
    # Together the shards cover a prefix of the stream with no hole.
    assert sorted(seen) == list(range(total * world * micro * steps))


def test_positions_advance_only_for_contributors_and_report_their_ranges() -> None:
    table = DataPositions({"r0": 8})
    trained = table.advance(["r2", "r0"], 4)
    assert trained == {"r0": (8, 12), "r2": (0, 4)}
    assert table.get("r0") == 12 and table.get("r1") == 0 and table.get("r2") == 4
    assert DataPositions.from_json(table.to_json()) == table


@pytest.mark.parametrize("bad", ['{"r0": -1}', '{"r0": "3"}', "[1, 2]", '{"r0": 1.5}'])
def test_position_tables_from_peers_are_validated(bad: str) -> None:
    with pytest.raises(ValueError):
        DataPositions.from_json(bad)
