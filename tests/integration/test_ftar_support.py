"""Helpers shared by the FTAR integration tests (no tests here): rings in this process."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta

import torch

from fthsdp.worker.ftar import FtarConfig, FtarRing, FtarWork

FAST = FtarConfig(
    chunk_bytes=64,
    chunks_in_flight=2,
    chunk_timeout=timedelta(seconds=5),
    exchange_timeout=timedelta(seconds=10),
    connect_timeout=timedelta(seconds=5),
)


def reconfigure_all(
    rings: Sequence[FtarRing], epoch: int, order: Sequence[int] | None = None
) -> None:
    """Reconfigure ``rings`` (in ``order``) concurrently, as members of one quorum would."""
    order = list(order) if order is not None else list(range(len(rings)))
    peers = [rings[i].address for i in order]
    with ThreadPoolExecutor(len(order)) as pool:
        futures = [
            pool.submit(rings[i].reconfigure, peers, pos, epoch) for pos, i in enumerate(order)
        ]
        for f in futures:
            f.result(timeout=30)


@contextmanager
def ring_set(n: int, config: FtarConfig = FAST, epoch: int = 1) -> Iterator[list[FtarRing]]:
    rings = [FtarRing(config) for _ in range(n)]
    try:
        reconfigure_all(rings, epoch)
        yield rings
    finally:
        for r in rings:
            r.close()


def exchange(
    rings: Sequence[FtarRing],
    inputs: Sequence[list[torch.Tensor]],
    *,
    contribute: Sequence[bool] | None = None,
    timeout: float = 20,
) -> list[FtarWork]:
    """One exchange across ``rings``; waits for all and returns the works (errors latched)."""
    contribute = contribute or [True] * len(rings)
    k = sum(contribute)
    works = [
        r.allreduce(x, contribute=c, num_contributors=max(k, 1))
        for r, x, c in zip(rings, inputs, contribute, strict=True)
    ]
    for w in works:
        wait_for(w.done, timeout)
    return works


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true (short yields, bounded); AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout}s")
        time.sleep(0.001)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def ftar_threads() -> int:
    return sum(t.name.startswith("ftar-") for t in threading.enumerate())
