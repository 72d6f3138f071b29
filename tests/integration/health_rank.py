"""An emulated training rank for the health tests: it "trains" by sleeping one step time per step
and reports through `TelemetryClient` exactly as a worker would (heartbeats with progress, step
records, parameter fingerprints). Faults on request: steps slowed after a step, or a corrupted
fingerprint after a step. Runs until killed; the token comes from FTHSDP_TOKEN."""

from __future__ import annotations

import argparse
import os
import sys
import time

from fthsdp.services.health.client import TelemetryClient


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--slow-after", type=int, default=-1, help="slow down after this step")
    parser.add_argument("--slow-factor", type=float, default=4.0)
    parser.add_argument("--flip-after", type=int, default=-1, help="corrupt digests after this")
    args = parser.parse_args()
    client = TelemetryClient(
        args.agent, os.environ["FTHSDP_TOKEN"], replica_id=args.replica, rank=args.rank
    )
    step = 0
    while True:
        started = time.time()
        slow = 0 <= args.slow_after < step
        time.sleep(args.step_ms / 1000 * (args.slow_factor if slow else 1.0))
        duration = time.time() - started
        client.step(
            step, started_at=started, duration_s=duration, tokens=1024, sum_seq_len_sq=2**20
        )
        corrupt = 0 <= args.flip_after < step
        client.fingerprint(step, f"{'bad' if corrupt else 'good'}-{step}")
        if step == 0:
            print("running", flush=True)
        step += 1


if __name__ == "__main__":
    sys.exit(main())
