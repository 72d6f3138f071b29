"""A rank-like process for the loader-worker tests: a forkserver DataLoader whose workers report
their pids; prints them as one JSON line, then waits to be killed."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from fthsdp.worker.loader_workers import end_with_this_process


class WorkerPids(Dataset[torch.Tensor]):
    """Each sample is the pid of the worker that loaded it."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.01)  # so that both workers get batches
        return torch.tensor(os.getpid())


def main() -> int:
    watched = sys.argv[1:] == ["--watched"]
    loader = DataLoader(
        WorkerPids(),
        batch_size=1,
        num_workers=2,
        multiprocessing_context="forkserver",
        worker_init_fn=end_with_this_process() if watched else None,
    )
    batches = iter(loader)  # held: a dropped iterator shuts its workers down
    pids: set[int] = set()
    while len(pids) < 2:
        pids.add(int(next(batches).item()))
    print(json.dumps(sorted(pids)), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
