"""The process layout the exchange tests share: REPLICAS x RANKS processes, gloo inside a
replica (file rendezvous in a temporary folder), and one real FTAR ring per rank across the
replicas, its peers found through address files in the same folder."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from fthsdp.worker.ftar import FtarRing
from fthsdp.worker.replica_group import ReplicaGroup
from tests.integration.test_ftar_support import FAST

REPLICAS = 2
RANKS = 2
TIMEOUT = 20.0


def peer_address(tmp: Path, replica: int, rank: int, timeout: float = TIMEOUT) -> str:
    """The ring address `rank` of `replica` published in `tmp`, waiting up to `timeout` s."""
    path = tmp / f"addr-r{replica}-k{rank}"
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"no address from replica {replica} rank {rank}")
        time.sleep(0.01)
    return path.read_text()


@contextmanager
def rank_with_ring(index: int, tmp: Path) -> Iterator[tuple[int, int, ReplicaGroup, FtarRing]]:
    """Process `index` as (replica, rank): joins its replica's gloo group, opens its FTAR ring,
    publishes the ring's address (renamed into place, so a reader never sees half of it) and
    connects it with the same rank of every replica; closes ring and group on the way out."""
    replica, rank = divmod(index, RANKS)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv-r{replica}", rank=rank, world_size=RANKS
    )
    group = ReplicaGroup(dist.group.WORLD, rank, RANKS)
    ring = FtarRing(replace(FAST, chunk_bytes=4096))
    try:
        (tmp / f"addr-r{replica}-k{rank}.tmp").write_text(ring.address)
        (tmp / f"addr-r{replica}-k{rank}.tmp").rename(tmp / f"addr-r{replica}-k{rank}")
        ring.reconfigure([peer_address(tmp, r, rank) for r in range(REPLICAS)], replica, 1)
        yield replica, rank, group, ring
    finally:
        ring.close()
        group.close()
