"""The fault plan's grammar and firing rules (each fault once per job, by its marker file)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fthsdp.worker.faults import Fault, FaultPlan, parse_faults


def test_the_grammar_names_replica_rank_step_point_and_seconds() -> None:
    assert parse_faults("r1:0:12:exchange, r1:1:*:hang,r0:0:*:slow_fetch:3") == [
        Fault(replica_id="r1", rank=0, step=12, point="exchange"),
        Fault(replica_id="r1", rank=1, step=None, point="hang"),
        Fault(replica_id="r0", rank=0, step=None, point="slow_fetch", seconds=3.0),
    ]


@pytest.mark.parametrize(
    "spec", ["r1:0:12", "r1:0:12:nowhere", "r1:0:12:hang:3", "r1:0:12:slow_fetch", "r1:x:1:hang"]
)
def test_a_bad_fault_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_faults(spec)


def test_a_hang_blocks_its_thread_at_its_step_only_and_fires_once(tmp_path: Path) -> None:
    env = {"FTHSDP_FAULTS": "r1:1:5:hang", "FTHSDP_FAULTS_DIR": str(tmp_path)}
    FaultPlan.from_env("r1", 0, env).hang(5)  # another rank: nothing
    plan = FaultPlan.from_env("r1", 1, env)
    plan.hang(4)  # another step: nothing
    assert not list(tmp_path.iterdir())

    thread = threading.Thread(target=plan.hang, args=(5,), daemon=True)
    thread.start()
    marker = tmp_path / "fault-r1-1-5-hang"
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the hang never fired"
        time.sleep(0.01)
    thread.join(0.2)
    assert thread.is_alive(), "a hang returned"
    # A restarted rank (a new plan over the same marker directory) does not hang again.
    FaultPlan.from_env("r1", 1, env).hang(5)
