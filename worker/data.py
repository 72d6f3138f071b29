"""Exactly-once data (invariant I2): deterministic shards and positions committed with the step.

Replica k owns the sample stream k, k+R, k+2R, ... (R = total replicas). Its *position* is how many
samples of that stream have been trained. Positions of every replica live in a table that is part
of the replicated training state: every replica that commits step n advances the positions of the
replicas that contributed to step n's gradient, so the table is identical on all healthy replicas,
travels with catch-up, and is stored in durable checkpoints. A restarted replica therefore resumes
exactly where its last *committed* contribution ended, whoever committed it. The loader that
feeds a rank from these positions is `worker.sampler.ExactlyOnceDataLoader`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_MAX_REPLICAS = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSpec:
    """Which samples a rank trains at a position."""

    replica_index: int
    """The replica's shard, 0..total_replicas-1."""
    total_replicas: int
    """Number of shards the stream is split into."""
    rank: int
    """This rank inside its replica."""
    world_size: int
    """Ranks per replica; each takes an equal micro-batch of the replica's batch."""
    micro_batch: int
    """Samples per rank per step."""

    def __post_init__(self) -> None:
        if not 0 <= self.replica_index < self.total_replicas:
            raise ValueError("replica_index must be in 0..total_replicas-1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError("rank must be in 0..world_size-1")
        if self.micro_batch < 1:
            raise ValueError("micro_batch must be >= 1")

    @property
    def samples_per_step(self) -> int:
        """Samples one replica consumes in one contributing step."""
        return self.micro_batch * self.world_size

    def sample_ids(self, position: int) -> range:
        """Global sample ids this rank trains when its replica stands at `position`."""
        first = position + self.rank * self.micro_batch
        start = first * self.total_replicas + self.replica_index
        return range(start, start + self.micro_batch * self.total_replicas, self.total_replicas)


class DataPositions:
    """Replica id → samples of its shard trained; identical on every healthy replica."""

    __slots__ = ("_positions",)

    def __init__(self, positions: Mapping[str, int] | None = None) -> None:
        self._positions: dict[str, int] = {}
        for replica, position in (positions or {}).items():
            self._set(replica, position)

    def _set(self, replica: str, position: int) -> None:
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"position of {replica!r} must be a non-negative int")
        if replica not in self._positions and len(self._positions) >= _MAX_REPLICAS:
            raise ValueError("too many replicas in the position table")
        self._positions[replica] = position

    def get(self, replica: str) -> int:
        """Samples of `replica`'s shard trained so far (0 if it never contributed)."""
        return self._positions.get(replica, 0)

    def advance(self, contributors: Iterable[str], samples: int) -> dict[str, tuple[int, int]]:
        """Records a committed step in which every contributor trained `samples`; returns each
        contributor's trained range [start, end)."""
        return self.advance_by(dict.fromkeys(contributors, samples))

    def advance_by(self, samples: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """Records a committed step in which each replica trained its own number of samples
        (uneven micro-steps); returns the trained range [start, end) of each replica that
        trained any."""
        trained = {}
        for replica in sorted(samples):
            count = samples[replica]
            if count < 0:
                raise ValueError(f"{replica!r} cannot train {count} samples")
            if count == 0:
                continue
            start = self.get(replica)
            self._set(replica, start + count)
            trained[replica] = (start, start + count)
        return trained

    def copy(self) -> DataPositions:
        """An independent table with the same positions (`advance` changes this one in place)."""
        return DataPositions(self._positions)

    def as_dict(self) -> dict[str, int]:
        """A copy of the table."""
        return dict(self._positions)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys) so identical tables have identical bytes."""
        return json.dumps(self._positions, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> DataPositions:
        """Parses and validates a table received from a peer or a checkpoint."""
        if len(text) > 1 << 20:
            raise ValueError("position table too large")
        raw = json.loads(text)
        if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
            raise ValueError("position table must be an object of replica id → int")
        return cls(raw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DataPositions) and self._positions == other._positions

    def __hash__(self) -> int:
        return hash(self.to_json())
