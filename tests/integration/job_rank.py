"""A rank for the launcher tests, without torch: `python job_rank.py DIR`.

It takes its identity when it is a spare, then appends one JSON line to DIR/ranks.jsonl (who it
is, whether it was a spare, its pid, rendezvous port and start wait) and behaves as DIR says: it
exits 3 at once while DIR/crash exists, exits 0 once DIR/stop exists, and otherwise waits."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from fthsdp.worker.spare import take_identity


def main() -> int:
    where = Path(sys.argv[1])
    identity = take_identity(warm=False)  # no torch here: these ranks train nothing
    line = {
        "replica": os.environ["FTHSDP_REPLICA_ID"],
        "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "port": int(os.environ["MASTER_PORT"]),
        "spare": identity is not None,
        "pid": os.getpid(),
        "await": os.environ.get("FTHSDP_AWAIT_REPLICAS_S"),
    }
    with (where / "ranks.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")
    print(f"rank {line['replica']}/{line['rank']} up", flush=True)  # into the replica's log
    if (where / "crash").exists():
        return 3
    while not (where / "stop").exists():
        time.sleep(0.02)
    return 0


if __name__ == "__main__":
    sys.exit(main())
