"""The demo job under torchrun: one `torch.distributed.run` job per replica, as in DESIGN.md.

A quorum service and one checkpoint sidecar per replica come from the embedded `LocalStack`; each
replica is `python -m torch.distributed.run --nproc-per-node 2 -m deploy.demo.train ...` (the
venv's torchrun), so ranks, world size and the replica's rendezvous come from torchrun's
environment, not from flags. One rank of one job is SIGKILLed mid-run: the other replica keeps
committing without it, and a fresh torchrun job for the same replica catches up from its peer.
The verdicts (I1 identical replicas, I2 exactly-once data) come from `deploy.demo.report`."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fthsdp.deploy.demo.events import CommitEvent, EventLog, FinalEvent, RunEvent, RunLog
from fthsdp.deploy.demo.report import build_report
from fthsdp.deploy.processes import free_port
from fthsdp.deploy.stack import LocalStack

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(150),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for rank pids"),
]

REPLICAS = ("r0", "r1")
RANKS = 2
MICRO_BATCH = 2
ROOT = Path(__file__).resolve().parents[2]


class TorchrunJob:
    """One replica as one torchrun job (the agent process and its worker ranks)."""

    def __init__(self, stack: LocalStack, run_dir: Path, token_file: Path, replica: str) -> None:
        self.replica = replica
        sidecar = stack.sidecars[replica]
        self.argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(RANKS),
            "--master-port", str(free_port()),
            "--max-restarts", "0",
            "-m", "fthsdp.deploy.demo.train",
            "--run-dir", str(run_dir),
            "--replica-id", replica,
            "--replica-index", str(REPLICAS.index(replica)),
            "--total-replicas", str(len(REPLICAS)),
            "--quorum", stack.quorum_address,
            "--checkpoint-url", sidecar.url,
            "--shm-dir", str(sidecar.shm_dir),
            "--token-file", str(token_file),
            "--stop-file", str(run_dir / "stop.json"),
            "--micro-batch", str(MICRO_BATCH),
        ]  # fmt: skip
        self.log = run_dir / "logs" / f"{replica}-torchrun.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            # Its own session: teardown can kill the agent and every rank it started.
            self.proc = subprocess.Popen(
                self.argv, cwd=ROOT, stdout=out, stderr=out, start_new_session=True
            )

    def rank_pids(self) -> dict[int, int]:
        """RANK → pid of the worker processes the torchrun agent started."""
        assert self.proc is not None
        pids: dict[int, int] = {}
        for pid in _children(self.proc.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for entry in env:
                if entry.startswith(b"RANK="):
                    pids[int(entry[5:])] = pid
        return pids

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _commits(run_dir: Path) -> list[CommitEvent]:
    return RunLog.load(run_dir).commits() if (run_dir / "replicas").is_dir() else []


def _wait_for(
    what: str, check: Callable[[], bool], timeout: float, jobs: list[TorchrunJob]
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        for job in jobs:
            if job.proc is not None and job.proc.poll() is not None:
                pytest.fail(f"{job.replica} exited with {job.proc.returncode} while waiting for "
                            f"{what}; see {job.log}:\n{job.log.read_text()[-3000:]}")  # fmt: skip
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[LocalStack, Path, Path, list[TorchrunJob]]]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    token_file = run_dir / "token"
    token_file.write_text(secrets.token_urlsafe(32))
    token_file.chmod(0o600)
    # The launcher's line the report reads (data layout), as the demo's supervisor writes it.
    launcher = EventLog(run_dir / "supervisor.jsonl")
    launcher.write(
        RunEvent(
            replicas=tuple(REPLICAS),
            world_size=RANKS,
            kill_every_s=None,
            kill_mode="process",
            seed=0,
            samples_per_step=RANKS * MICRO_BATCH,
            total_replicas=len(REPLICAS),
        )
    )
    launcher.close()
    jobs: list[TorchrunJob] = []
    with LocalStack(
        run_dir=run_dir,
        token_file=token_file,
        hosts=list(REPLICAS),
        checkpoint_dir=run_dir / "checkpoints",
        min_replicas=1,
    ) as stack:
        try:
            yield stack, run_dir, token_file, jobs
        finally:
            for job in jobs:
                job.kill()


def test_torchrun_replicas_survive_a_rank_kill_and_catch_up(
    cluster: tuple[LocalStack, Path, Path, list[TorchrunJob]],
) -> None:
    """I1 + I2 across two torchrun jobs; the survivor keeps committing alone while a rank of the
    other job is dead; a restarted torchrun job catches up from its peer and is identical."""
    stack, run_dir, token_file, jobs = cluster
    r0, r1 = (TorchrunJob(stack, run_dir, token_file, r) for r in REPLICAS)
    jobs += [r0, r1]
    r0.start()
    r1.start()

    def both_at(step: int) -> Callable[[], bool]:
        def check() -> bool:
            together = [c for c in _commits(run_dir) if set(c.healthy) == set(REPLICAS)]
            return {c.replica for c in together if c.step >= step} == set(REPLICAS)

        return check

    _wait_for("both replicas to commit together", both_at(5), 60, jobs)

    # SIGKILL rank 1 of r1 (not its leader: its rank 0 must notice and take the replica down).
    victim = r1.rank_pids()[1]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    assert r1.wait(timeout=40) != 0, "torchrun must report the failed job"
    _wait_for(
        "r0 to commit alone",
        lambda: any(
            c.replica == "r0" and c.t > killed_at and c.healthy == ("r0",)
            for c in _commits(run_dir)
        ),
        30,
        [r0],
    )
    # A fresh torchrun job for r1 (new incarnation) catches up from r0.
    restarted_at = time.time()
    r1.start()
    _wait_for(
        "r1 to catch up",
        lambda: any(
            c.replica == "r1" and c.recovered and c.t > restarted_at for c in _commits(run_dir)
        ),
        60,
        [r0, r1],
    )
    alone = [
        c
        for c in _commits(run_dir)
        if c.replica == "r0" and killed_at < c.t and c.healthy == ("r0",)
    ]
    # Stop both a few steps after r1 trained with r0 again.
    _wait_for("r1 to train again", both_at(max(c.step for c in alone) + 3), 30, [r0, r1])
    # Far enough ahead that every rank reads the file (before each step) before reaching it:
    # one that read it only past that step would stop later than the others.
    stop_at = max(c.step for c in _commits(run_dir)) + 20
    staging = run_dir / "stop.json.tmp"
    staging.write_text(json.dumps({"stop_at_step": stop_at}))
    staging.replace(run_dir / "stop.json")
    assert r0.wait(timeout=60) == 0, r0.log.read_text()[-3000:]
    assert r1.wait(timeout=60) == 0, r1.log.read_text()[-3000:]

    report = build_report(run_dir)
    assert report["invariants"]["I1"]["ok"], report["invariants"]["I1"]
    assert report["invariants"]["I2"]["ok"], report["invariants"]["I2"]
    log = RunLog.load(run_dir)
    finals = {r: [e for e in log.replicas[r] if isinstance(e, FinalEvent)][-1] for r in REPLICAS}
    assert finals["r0"].step == finals["r1"].step >= stop_at
    assert finals["r0"].fingerprint == finals["r1"].fingerprint  # I1
    # Both replicas committed the same steps since r1 came back, in the same quorums.
    steps = {r: {c.step: c.quorum_id for c in log.commits(r)} for r in REPLICAS}
    rejoined = min(c.step for c in log.commits("r1") if c.recovered and c.t > restarted_at)
    tail = range(rejoined, finals["r0"].step)
    assert all(steps["r0"].get(s) == steps["r1"].get(s) is not None for s in tail), steps
    # The survivor's invariant: r0 kept training alone while r1 was down, up to the step r1
    # caught up to, with no step skipped (I2 above checks that no sample was).
    assert alone and all(c.trained.keys() == {"r0"} for c in alone)
    assert {c.step for c in alone} == set(range(alone[0].step, rejoined + 1)), (alone, rejoined)
