"""`fthsdp up --replicas 2 --spares 1 -- python examples/ddp_train_fthsdp.py`: a user's own script
run by `up`'s launcher beside the stack. A SIGKILLed rank's replica is taken over by the warm
spare (a new incarnation that catches up from its peer), the job trains to its last step and
`up` exits 0. I1: both replicas end with one fingerprint."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable

import pytest

from tests.e2e.up_support import ROOT, Up, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

STEPS = 300


def _log(up: Up, replica: str) -> str:
    path = up.run_dir / "logs" / f"{replica}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_warm_spare_takes_over_a_killed_rank_of_the_users_job(
    start_up: Callable[..., Up],
) -> None:
    script = ROOT / "examples" / "ddp_train_fthsdp.py"
    up = start_up(
        "--replicas", "2", "--spares", "1", "--restart-delay-s", "60",
        "--", sys.executable, str(script), "--steps", str(STEPS), "--workers", "0",
        "--batch-size", "8",
    )  # fmt: skip
    wait_for("a warm spare", lambda: "spares warm: 1/1" in up.output(), timeout=120)
    wait_for("r0 training", lambda: re.search(r"^step [1-9]\d* loss", _log(up, "r0"), re.M))
    [victim] = up.job()["r0"]
    os.kill(victim, signal.SIGKILL)
    # A 60 s restart delay for fresh processes: only the spare brings r0 back in time.
    wait_for("the takeover", lambda: "r0 taken over by 1 warm spare(s)" in up.output())
    assert "r0: rank 0 exited with -9; restarting" in up.output()
    assert up.proc.wait(timeout=300) == 0, up.output()[-4000:]
    assert "the job finished" in up.output()
    prints = set()
    for replica in ("r0", "r1"):
        done = re.findall(rf"done at step {STEPS} fingerprint ([0-9a-f]{{64}})", _log(up, replica))
        assert len(done) == 1, _log(up, replica)[-4000:]
        prints.update(done)
    assert len(prints) == 1, prints  # I1
