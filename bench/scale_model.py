"""The pure parts of `bench.scale`: the job's shape, the emulated ranks' names and endpoints, the
failures to inject, and the arithmetic of stages that may not complete before their deadline.

No I/O and no clock here: every time is a monotonic timestamp passed in (CLOCK_MONOTONIC is one
clock for every process of the machine, so the client processes' timestamps compare)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fthsdp.bench.emulation import replica_name
from fthsdp.services.quorum.domain import RankEndpoint

MAX_RANKS = 1 << 20
"""The largest job the harness emulates (about 10x the paper's 98K GPUs)."""
_SHAPE = re.compile(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*")


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """R replicas x W ranks, in hosts of `ranks_per_host` ranks."""

    replicas: int
    """R: replicas (the unit of failure)."""
    ranks: int
    """W: ranks per replica."""
    ranks_per_host: int = 8
    """Ranks on one host (one node agent each)."""

    def __post_init__(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"a shape needs at least 2 replicas (one dies), got {self.replicas}")
        if self.ranks < 1:
            raise ValueError(f"a replica needs at least 1 rank, got {self.ranks}")
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks per host must be >= 1, got {self.ranks_per_host}")
        if self.replicas * self.ranks > MAX_RANKS:
            raise ValueError(
                f"{self.replicas} x {self.ranks} = {self.replicas * self.ranks:,} ranks is more "
                f"than the {MAX_RANKS:,} this harness emulates"
            )

    @property
    def total_ranks(self) -> int:
        """R x W."""
        return self.replicas * self.ranks

    @property
    def hosts_per_replica(self) -> int:
        """Hosts of one replica (the last one may hold fewer ranks)."""
        return math.ceil(self.ranks / self.ranks_per_host)

    @property
    def hosts(self) -> int:
        """Hosts (node agents) of the job."""
        return self.replicas * self.hosts_per_replica

    def label(self) -> str:
        """`RxW`, as given on the command line."""
        return f"{self.replicas}x{self.ranks}"


def parse_shape(text: str, ranks_per_host: int = 8) -> Shape:
    """`RxW` (e.g. `12x8192`) as a Shape; ValueError with the reason for anything else."""
    match = _SHAPE.fullmatch(text)
    if match is None:
        raise ValueError(
            f"a shape is REPLICASxRANKS with positive integers, e.g. 12x8192, got {text!r}"
        )
    return Shape(replicas=int(match[1]), ranks=int(match[2]), ranks_per_host=ranks_per_host)


# ---- names and endpoints (the same names as bench.emulation, so health records match) --------


def host_of(replica: int, rank: int, ranks_per_host: int) -> str:
    """The host a rank runs on (bench.emulation's naming)."""
    return f"host-{replica:03d}-{rank // ranks_per_host}"


def endpoint(shape: Shape, replica: int, rank: int) -> RankEndpoint:
    """A rank's endpoints: one 10.x.y.z address per host (real-sized strings), a port per rank."""
    host = replica * shape.hosts_per_replica + rank // shape.ranks_per_host
    ip = f"10.{(host >> 16) & 255}.{(host >> 8) & 255}.{host & 255}"
    return RankEndpoint(
        ftar=f"{ip}:{29500 + rank % shape.ranks_per_host}", checkpoint=f"http://{ip}:8080"
    )


def endpoints(shape: Shape, replica: int) -> list[RankEndpoint]:
    """Every rank's endpoints of one replica, in rank order (its Join)."""
    return [endpoint(shape, replica, i) for i in range(shape.ranks)]


def ring_order(members: Sequence[int]) -> list[int]:
    """Replica indices in ring order: replica-id order, as the quorum service sorts members."""
    return sorted(members, key=replica_name)


def ring_neighbours(ring: Sequence[int], replica: int) -> tuple[int, int]:
    """The replicas before and after `replica` in `ring` (itself, in a ring of one)."""
    position = ring.index(replica)
    return ring[position - 1], ring[(position + 1) % len(ring)]


def neighbours(shape: Shape, members: Sequence[int], replica: int, rank: int) -> tuple[str, str]:
    """The FTAR addresses before and after rank `rank` of `replica` in its ring over `members`
    (replica indices)."""
    before, after = ring_neighbours(ring_order(members), replica)
    return endpoint(shape, before, rank).ftar, endpoint(shape, after, rank).ftar


@dataclass(frozen=True, kw_only=True, slots=True)
class Victim:
    """One injected failure: rank `rank` of replica `replica` dies."""

    replica: int
    rank: int

    @property
    def replica_id(self) -> str:
        return replica_name(self.replica)


def victims(shape: Shape, failures: int) -> list[Victim]:
    """`failures` victims on distinct replicas, from the middle of the job; never a replica's
    leader (rank 0) when it has other ranks, so the leader lives on until the teardown."""
    if not 0 <= failures < shape.replicas:
        raise ValueError(
            f"--failures must be in 0..{shape.replicas - 1} (one replica must survive), "
            f"got {failures}"
        )
    out = []
    for f in range(failures):
        replica = (shape.replicas // 2 + f) % shape.replicas
        rank = 0 if shape.ranks == 1 else 1 + (shape.ranks // 3 + f) % (shape.ranks - 1)
        out.append(Victim(replica=replica, rank=rank))
    return out


def client_replicas(shape: Shape, clients: int) -> list[list[int]]:
    """The replicas each client process emulates: round-robin, none left empty."""
    if clients < 1:
        raise ValueError(f"--clients must be >= 1, got {clients}")
    groups = [list(range(c, shape.replicas, clients)) for c in range(clients)]
    return [g for g in groups if g]


# ---- stages ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """How far one stage of a failure got: `done` of `total` parties reached it; `seconds` from
    the stage's origin to the last of them, or None when some never did before the deadline."""

    name: str
    done: int
    total: int
    seconds: float | None
    deadline_s: float

    @property
    def complete(self) -> bool:
        return self.seconds is not None

    def describe(self) -> str:
        """`0.812 s`, or `41,203 / 98,304 after 60 s` for a stage that did not complete."""
        if self.seconds is not None:
            return f"{self.seconds:.3f} s"
        return f"{self.done:,} / {self.total:,} after {self.deadline_s:g} s"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "done": self.done,
            "total": self.total,
            "seconds": self.seconds,
            "complete": self.complete,
            "deadline_s": self.deadline_s,
        }


def stage(
    name: str, origin: float, times: Sequence[float | None], total: int, deadline_s: float
) -> Stage:
    """The stage reached at `times` (None: not reached; NaN counts as None) by `total` parties,
    measured from `origin`: complete when every party reached it within `deadline_s`."""
    reached = [t for t in times if t is not None and not math.isnan(t) and t - origin <= deadline_s]
    complete = len(reached) == total and total > 0
    seconds = max(reached) - origin if complete else None
    return Stage(name=name, done=len(reached), total=total, seconds=seconds, deadline_s=deadline_s)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rounds_of(
    per_client: Sequence[Sequence[tuple[float, float]]],
) -> list[float]:
    """Client-side round latencies from each client process's per-step (last request sent, last
    answer received): for every step, the last answer anywhere minus the last request anywhere
    (a round forms only once its last participant asked). Steps missing from a client are cut."""
    steps = min((len(c) for c in per_client), default=0)
    return [
        max(c[s][1] for c in per_client) - max(c[s][0] for c in per_client) for s in range(steps)
    ]
