"""`fthsdp up --replicas`'s launcher (`deploy.job`) and its warm spares (`deploy.spares`), with
real rank processes of a small script (no torch): identities handed over the spare pipes, a
killed rank taking its replica down, spares taking over, the fallback, a crash loop."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fthsdp.deploy.failure_reporter import FailureReporter
from fthsdp.deploy.job import JobConfig, JobLauncher
from fthsdp.deploy.processes import GaveUp
from fthsdp.deploy.spares import SparePool
from fthsdp.services.quorum.client import QuorumClient
from fthsdp.services.quorum.domain import RankEndpoint
from fthsdp.services.quorum.server import QuorumServerThread
from fthsdp.worker.spare import Identity

pytestmark = pytest.mark.timeout(120)

RANK_SCRIPT = Path(__file__).with_name("job_rank.py")


def _ranks(where: Path) -> list[dict[str, object]]:
    path = where / "ranks.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _until(what: str, probe: Callable[[], object], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class _Sink:
    """Failure reports, each acknowledged at the next poll."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self._unacked: list[str] = []

    def send(self, replica_id: str, reason: str) -> None:
        self.sent.append((replica_id, reason))
        self._unacked.append(replica_id)

    def acknowledged(self) -> list[str]:
        done, self._unacked = self._unacked, []
        return done


class _Run:
    """A launcher under test, polled by hand; what it said and which replicas it reported failed."""

    def __init__(self, tmp_path: Path, **config: object) -> None:
        self.dir = tmp_path
        self.reports: list[str] = []
        self.failures = _Sink()
        self.launcher = JobLauncher(
            JobConfig(command=(sys.executable, str(RANK_SCRIPT), str(tmp_path)), **config),  # type: ignore[arg-type]
            dict(os.environ),
            tmp_path / "logs",
            failures=self.failures,
            report=self.reports.append,
        )

    def poll_until(self, what: str, probe: Callable[[], object], timeout: float = 60.0) -> None:
        def step() -> object:
            self.finished = self.launcher.poll(time.monotonic())
            return probe()

        _until(what, step, timeout)


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Callable[..., _Run]]:
    runs: list[_Run] = []

    def make(**config: object) -> _Run:
        runs.append(_Run(tmp_path, **config))
        return runs[-1]

    yield make
    for r in runs:
        r.launcher.stop_all(5.0)


def test_a_spare_takes_its_identity_and_an_emptied_pool_exits_cleanly(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    argv = [sys.executable, str(RANK_SCRIPT), str(tmp_path)]
    pool = SparePool(2, argv, dict(os.environ), tmp_path / "logs")
    try:
        _until("two warm spares", lambda: (pool.refill(), pool.warm)[1] == 2)
        [spare] = pool.take(1) or []
        env = {"FTHSDP_REPLICA_ID": "r5", "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}
        spare.hand_over(Identity(env=env, log_file=str(tmp_path / "r5.log")))
        _until("the spare's line", lambda: _ranks(tmp_path))
        [line] = _ranks(tmp_path)
        pid = spare.proc.pid
        assert line == {
            "replica": "r5",
            "rank": 1,
            "world": 2,
            "port": 1234,
            "spare": True,
            "pid": pid,
            "await": None,
        }
        assert "rank r5/1 up" in (tmp_path / "r5.log").read_text()  # its output moved there
        left = pool.take(1)
        assert left is not None and pool.take(1) is None  # none left to take
        waiting = left[0].proc
        left[0].dismiss()
        assert waiting.returncode == 0  # it exited by itself when its pipe closed
        (tmp_path / "stop").touch()
        assert spare.proc.wait(10) == 0
    finally:
        (tmp_path / "stop").touch()
        pool.stop()


def test_a_killed_rank_takes_its_replica_down_and_warm_spares_take_over(
    run: Callable[..., _Run],
) -> None:
    r = run(replicas=2, ranks=2, spares=2, restart_delay_s=30.0)
    r.launcher.start_all()
    r.poll_until(
        "4 ranks and 2 warm spares", lambda: len(_ranks(r.dir)) == 4 and r.launcher.spares.warm == 2
    )
    first = {(x["replica"], x["rank"]): x for x in _ranks(r.dir)}
    assert not any(x["spare"] for x in first.values())
    # The first launch starts together (the Manager's start wait); restarts never wait.
    assert {x["await"] for x in first.values()} == {"30.0"}
    assert first["r0", 0]["port"] == first["r0", 1]["port"] != first["r1", 0]["port"]
    survivor_pids = set(r.launcher.pids()["r1"])

    os.kill(int(first["r0", 1]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    # A 30 s restart delay: only spares can bring r0 back within the deadline.
    r.poll_until("r0 taken over", lambda: len(_ranks(r.dir)) == 6, timeout=20)
    assert r.failures.sent == [("r0", f"rank 1 exited with {-signal.SIGKILL}")]
    taken = {(x["replica"], x["rank"]): x for x in _ranks(r.dir)[4:]}
    assert set(taken) == {("r0", 0), ("r0", 1)} and all(x["spare"] for x in taken.values())
    assert {x["await"] for x in taken.values()} == {"0.0"}
    assert taken["r0", 0]["port"] == taken["r0", 1]["port"] != first["r0", 0]["port"]
    assert set(r.launcher.pids()["r1"]) == survivor_pids  # the other replica never noticed
    assert any("taken over by 2 warm spare(s)" in line for line in r.reports)

    (r.dir / "stop").touch()
    r.poll_until("the job's end", lambda: r.finished)
    assert r.launcher.pids() == {"r0": [], "r1": []}


def test_without_warm_spares_a_failed_replica_restarts_fresh(run: Callable[..., _Run]) -> None:
    r = run(replicas=1, ranks=1, restart_delay_s=0.0)
    r.launcher.start_all()
    r.poll_until("the rank", lambda: _ranks(r.dir))
    os.kill(int(_ranks(r.dir)[0]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    r.poll_until("the restart", lambda: len(_ranks(r.dir)) == 2)
    assert not _ranks(r.dir)[1]["spare"]
    assert [x["await"] for x in _ranks(r.dir)] == ["30.0", "0.0"]
    assert any("restarted as fresh processes" in line for line in r.reports)


def test_a_replica_that_keeps_crashing_makes_the_launcher_give_up(run: Callable[..., _Run]) -> None:
    r = run(replicas=1, ranks=1, restart_delay_s=0.0, max_failures_in_a_row=2)
    (r.dir / "crash").touch()
    r.launcher.start_all()
    with pytest.raises(GaveUp, match="r0 failed 3 times in a row"):
        r.poll_until("never", lambda: False)
    assert len(_ranks(r.dir)) == 3 and [rid for rid, _ in r.failures.sent] == ["r0"] * 3


def test_the_reporter_child_evicts_a_failed_replica_and_acknowledges_it(
    quorum_thread: QuorumServerThread, token: str, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(token)
    client = QuorumClient(quorum_thread.address, token)
    try:
        endpoint = RankEndpoint(ftar="127.0.0.1:1", checkpoint="http://127.0.0.1:2")
        client.join("r0", [endpoint])
        env = {**os.environ, "FTHSDP_QUORUM": quorum_thread.address}
        env["FTHSDP_TOKEN_FILE"] = str(token_file)
        reporter = FailureReporter(env, tmp_path / "reporter.log")
        try:
            reporter.send("r0", "rank 1 exited with -9\n(a second line)")
            acked: list[str] = []
            _until("the acknowledgement", lambda: acked.extend(reporter.acknowledged()) or acked)
            assert acked == ["r0"]
            assert [m.replica_id for m in client.status().members] == []  # evicted
            log = (tmp_path / "reporter.log").read_text()
            assert "reported r0: rank 1 exited with -9 (a second line)" in log
        finally:
            reporter.stop()
    finally:
        client.close()
