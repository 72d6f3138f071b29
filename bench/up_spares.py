"""Time to healthy of a user's job under `fthsdp up`, warm spares against fresh processes.

    python -m bench.up_spares --kills 3 --json bench-up-spares.json

Runs `fthsdp up --replicas 2 --spares S --restart-delay-s 0 -- python
examples/ddp_train_fthsdp.py` twice in one invocation (S = 0, then `--spares`) and SIGKILLs r0's
rank `--kills` times in each, once the job trains on both replicas (and, with spares, once the
pool is warm again). Per kill: from the SIGKILL to r0 being a live member of the quorum service
again, at a new incarnation, at most 2 steps behind r1 (asked for the quorum: it caught up), as
read from the quorum service every 20 ms. Prints medians and their ratio; not a pass/fail test."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fthsdp.bench.recovery import machine
from fthsdp.services.common.tokens import load_token
from fthsdp.services.quorum.client import QuorumClient
from fthsdp.services.quorum.domain import MemberStatus

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ddp_train_fthsdp.py"
T = TypeVar("T")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="kills per configuration (3)")
    p.add_argument("--spares", type=int, default=1, help="the pool of the spares run (1)")
    p.add_argument("--settle-s", type=float, default=3.0, help="training between kills (3)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--work-dir", type=Path, help="run dirs (default: a fresh temp dir)")
    return p.parse_args(argv)


def _poll(what: str, probe: Callable[[], T | None], timeout: float = 180.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


class _Up:
    """One `fthsdp up` running the example job, and a quorum client to watch it."""

    def __init__(self, run_dir: Path, spares: int) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True)
        self.out = run_dir.parent / f"{run_dir.name}.out"
        argv = [
            sys.executable, "-m", "fthsdp.deploy.cli", "up", "--run-dir", str(run_dir),
            "--replicas", "2", "--spares", str(spares), "--restart-delay-s", "0", "--",
            sys.executable, str(SCRIPT), "--steps", "1000000", "--workers", "0",
            "--batch-size", "8",
        ]  # fmt: skip
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        env_file = run_dir / "fthsdp.env"
        _poll("the env file", env_file.exists)
        lines = env_file.read_text().splitlines()
        env = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
        token = load_token(path=env["FTHSDP_TOKEN_FILE"]).value
        self.client = QuorumClient(env["FTHSDP_QUORUM"], token)

    def members(self) -> dict[str, MemberStatus]:
        return {m.replica_id: m for m in self.client.status().members}

    def r0_pid(self) -> int:
        state = json.loads((self.run_dir / "services.json").read_text())
        [pid] = state["job"]["r0"]
        return int(pid)

    def warm(self, spares: int) -> bool:
        said = [ln for ln in self.out.read_text().splitlines() if "spares warm:" in ln]
        return bool(said) and said[-1].endswith(f"{spares}/{spares}")

    def stop(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _caught_up(members: dict[str, MemberStatus], old_incarnation: int | None) -> bool:
    r0, r1 = members.get("r0"), members.get("r1")
    if r0 is None or r1 is None or r0.step is None or r1.step is None:
        return False
    return r0.live and r0.incarnation != old_incarnation and abs(r0.step - r1.step) <= 2


def measure(run_dir: Path, spares: int, args: argparse.Namespace) -> list[float]:
    up = _Up(run_dir, spares)
    seconds = []
    try:
        for _ in range(args.kills):
            _poll("both replicas training", lambda: _caught_up(up.members(), None))
            if spares:
                _poll("a warm pool", lambda: up.warm(spares))
            time.sleep(args.settle_s)  # training goes on: not waiting for a state
            incarnation = up.members()["r0"].incarnation
            killed = time.monotonic()
            os.kill(up.r0_pid(), signal.SIGKILL)
            back = lambda old=incarnation: _caught_up(up.members(), old)  # noqa: E731
            _poll("r0 back", back, timeout=120)
            seconds.append(time.monotonic() - killed)
            print(f"spares={spares}: healthy after {seconds[-1]:.2f} s", flush=True)
    finally:
        up.stop()
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fthsdp-bench-up-spares-"))
    info = machine()
    rows = {
        "fresh": measure(work / "fresh", 0, args),
        "spares": measure(work / "spares", args.spares, args),
    }
    medians = {name: statistics.median(values) for name, values in rows.items()}
    print(f"{'restart':<8} {'kills':>5} {'median s':>9} {'max s':>7}")
    for name, values in rows.items():
        print(f"{name:<8} {len(values):>5} {medians[name]:>9.2f} {max(values):>7.2f}")
    ratio = medians["fresh"] / medians["spares"]
    print(f"fresh / spares: {ratio:.1f}x")
    if args.json:
        document: dict[str, Any] = {
            "time_to_healthy_s": rows,
            "median_s": medians,
            "fresh_over_spares": ratio,
            "args": vars(args),
            "machine": info,
        }
        args.json.write_text(json.dumps(document, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
