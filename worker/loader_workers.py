"""DataLoader workers that end with their rank.

A worker started through `forkserver` (or `spawn`) is a child of the server process, not of the
rank: when the rank is SIGKILLed (a failure, a teardown), PyTorch's worker watchdog, which watches
the worker's parent, sees nothing, and the workers (and with them the server, which lives while
they do) stay behind as orphans, holding memory and CPU on the host. `end_with_this_process`
wraps a `worker_init_fn` so that each worker also watches the process that created the
DataLoader, by pid and start time, and exits once it is gone."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from fthsdp.services.common.process_ref import ProcessRef, alive, this_process

WATCH_INTERVAL_S = 0.5
"""How often a worker checks that its rank still lives (the orphan's lifetime bound)."""


class _EndsWithRank:
    """A picklable `worker_init_fn`: starts the watch, then runs the user's own init."""

    def __init__(self, rank: ProcessRef, then: Callable[[int], None] | None) -> None:
        self.rank = rank
        self.then = then

    def __call__(self, worker_id: int) -> None:
        if self.rank.start:  # without /proc (start unknown) there is nothing to watch by
            threading.Thread(
                target=_exit_after, args=(self.rank,), name="fthsdp-rank-watch", daemon=True
            ).start()
        if self.then is not None:
            self.then(worker_id)


def _exit_after(rank: ProcessRef) -> None:
    while alive(rank):
        time.sleep(WATCH_INTERVAL_S)
    os._exit(0)  # the rank is gone: nobody reads this worker's batches any more


def end_with_this_process(
    worker_init_fn: Callable[[int], None] | None = None,
) -> Callable[[int], None]:
    """A `worker_init_fn` that makes each worker exit once the calling process is gone, then
    calls `worker_init_fn` (which must pickle, as any with forkserver or spawn)."""
    return _EndsWithRank(this_process(), worker_init_fn)
