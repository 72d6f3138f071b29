"""The demo report on synthetic run directories: exact sample accounting, invariants I1 and I2
(holding and violated), failure timings and the effective training time.

`SyntheticRun` is reused by the plot and view tests: a three-replica run where r1 is killed at
t0+4.5 after committing step 3, the survivors stall 1.5 s beyond the usual 1 s interval, r1
restarts, catches up in step 6 and contributes again from step 7."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fthsdp.deploy.demo.events import JsonlTail, RunLog, StartEvent
from fthsdp.deploy.demo.report import build_report, write_report

T0 = 1000.0
SPS = 8
FINGERPRINT = "ab" * 32
ALL = ["r0", "r1", "r2"]


def commit_time(step: int) -> float:
    return T0 + 1 + step if step <= 3 else T0 + 6.5 + (step - 4)


def contributors(step: int) -> list[str]:
    return ["r0", "r2"] if 4 <= step <= 6 else ALL


@dataclass
class SyntheticRun:
    """Lines of a run, written up to a time cut (so a test can watch it grow)."""

    root: Path
    fingerprints: dict[str, str] = field(default_factory=lambda: dict.fromkeys(ALL, FINGERPRINT))
    span_override: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    """(step, replica) → [start, end] every logger records instead of the true range."""
    lines: list[tuple[float, str, str]] = field(default_factory=list)
    written: float = float("-inf")

    def __post_init__(self) -> None:
        self._sup(T0, "run", replicas=ALL, world_size=2, kill_every_s=20.0, kill_mode="process",
                  seed=0, samples_per_step=SPS, total_replicas=3)  # fmt: skip
        self._sup(T0 + 0.5, "quorum", quorum_id=1, members=ALL, healthy=ALL, max_step=0)
        for r in ("r0", "r2"):
            self._rep(r, T0 + 0.1, "start", incarnation=0, step=0)
        self._rep("r1", T0 + 0.2, "start", incarnation=0, step=0)
        positions = dict.fromkeys(ALL, 0)
        for step in range(10):
            trained = {}
            for r in contributors(step):
                span = [positions[r], positions[r] + SPS]
                trained[r] = self.span_override.get((step, r), span)
                positions[r] += SPS
            loggers = ALL if step <= 3 or step >= 6 else ["r0", "r2"]
            for r in loggers:
                recovered = r == "r1" and step == 6
                self._rep(r, commit_time(step), "commit", step=step, quorum_id=self._qid(step),
                          healthy=contributors(step), recovered=recovered, trained=trained,
                          loss=None if recovered else 3.0 - 0.1 * step,
                          tokens=0 if recovered else SPS * 64, attempts=1,
                          seconds={"quorum": 0.01, "total": 0.9})  # fmt: skip
        self._sup(T0 + 4.5, "inject", replica="r1", mode="process", rank=1)
        self._sup(T0 + 4.6, "exit", replica="r1", rank=1, code=-9)
        # The killed leader left half a line; the next incarnation appends right after it.
        self.lines.append((T0 + 4.7, "replicas/r1.jsonl", '{"t": 1004.7, "event": "com'))
        self._sup(T0 + 5.0, "quorum", quorum_id=2, members=["r0", "r2"],
                  healthy=["r0", "r2"], max_step=4)  # fmt: skip
        self._sup(T0 + 6.9, "restart", replica="r1")
        self._rep("r1", T0 + 7.0, "start", incarnation=1, step=4)
        self._sup(T0 + 8.0, "quorum", quorum_id=3, members=ALL, healthy=["r0", "r2"], max_step=6)
        self._sup(T0 + 9.0, "quorum", quorum_id=4, members=ALL, healthy=ALL, max_step=7)
        for r in ALL:
            self._rep(r, T0 + 11.8, "final", step=10, fingerprint=self.fingerprints[r])
        self._sup(T0 + 12.0, "end")
        self.lines.sort(key=lambda line: line[0])

    @staticmethod
    def _qid(step: int) -> int:
        return 1 if step <= 3 else 2 if step <= 5 else 3 if step == 6 else 4

    def _sup(self, t: float, event: str, **fields: Any) -> None:
        self.lines.append(
            (t, "supervisor.jsonl", json.dumps({"t": t, "event": event, **fields}) + "\n")
        )

    def _rep(self, replica: str, t: float, event: str, **fields: Any) -> None:
        line = json.dumps({"t": t, "event": event, "replica": replica, **fields}) + "\n"
        self.lines.append((t, f"replicas/{replica}.jsonl", line))

    def write_until(self, cut: float = float("inf")) -> Path:
        (self.root / "replicas").mkdir(parents=True, exist_ok=True)
        for t, name, text in self.lines:
            if self.written < t <= cut:
                with (self.root / name).open("a", encoding="utf-8") as f:
                    f.write(text)
        self.written = max(self.written, cut)
        return self.root


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return SyntheticRun(tmp_path).write_until()


def test_samples_are_exact_ranges_per_step(run_dir: Path) -> None:
    report = build_report(run_dir)
    r1 = report["replicas"]["r1"]
    assert r1["final_step"] == 10
    assert r1["fingerprint"] == FINGERPRINT
    assert [row["step"] for row in r1["samples"]] == [0, 1, 2, 3, 7, 8, 9]
    assert r1["samples"][4] == {"step": 7, "start": 32, "end": 40}
    assert r1["coverage"] == [[0, 56]]
    assert report["replicas"]["r0"]["coverage"] == [[0, 80]]
    assert report["inconsistencies"] == []
    # The half line was skipped without losing the start line glued to it.
    assert report["skipped_lines"] == []
    assert report["replicas"]["r1"]["commits"] == 8
    starts = [e for e in RunLog.load(run_dir).replicas["r1"] if isinstance(e, StartEvent)]
    assert [s.step for s in starts] == [0, 4]


def test_invariants_hold_on_a_clean_run(run_dir: Path) -> None:
    invariants = build_report(run_dir)["invariants"]
    assert invariants["I1"]["ok"] is True
    assert invariants["I2"] == {"ok": True, "detail": "216 samples trained exactly once"}


def test_failure_timings(run_dir: Path) -> None:
    (failure,) = build_report(run_dir)["failures"]
    assert failure["replica"] == "r1"
    assert failure["mode"] == "process"
    assert failure["t"] == pytest.approx(4.5)
    assert failure["step"] == 4
    assert failure["detection_s"] == pytest.approx(0.5)
    # Gap 3 → 4 is 2.5 s against a median of 1 s.
    assert failure["survivor_stall_s"] == pytest.approx(1.5)
    # First commit after the restart: the catch-up in step 6 at t0+8.5.
    assert failure["time_to_healthy_s"] == pytest.approx(4.0)


def test_effective_training_time_and_summary(run_dir: Path) -> None:
    report = build_report(run_dir)
    # 10 steps x 3 replicas possible; r1 missed steps 4, 5 and 6.
    assert report["effective_training_time"] == pytest.approx(27 / 30, abs=1e-4)
    summary = report["summary"]
    assert summary["steps_committed"] == 10
    assert summary["wall_time_s"] == pytest.approx(12.0)
    assert summary["median_step_s"] == pytest.approx(1.0)
    assert summary["tokens"] == 27 * SPS * 64
    assert summary["tokens_per_s"] == pytest.approx(27 * SPS * 64 / 12.0, abs=0.1)
    assert summary["failures_injected"] == 1


def test_i1_violation_is_reported(tmp_path: Path) -> None:
    run = SyntheticRun(
        tmp_path, fingerprints={"r0": FINGERPRINT, "r1": FINGERPRINT, "r2": "cd" * 32}
    )
    report = build_report(run.write_until())
    assert report["invariants"]["I1"]["ok"] is False
    assert "r2" in report["invariants"]["I1"]["detail"]
    assert report["invariants"]["I2"]["ok"] is True


def test_i1_ignores_replicas_behind_the_maximum_step(tmp_path: Path) -> None:
    run = SyntheticRun(
        tmp_path, fingerprints={"r0": FINGERPRINT, "r1": "00" * 32, "r2": FINGERPRINT}
    )
    run.lines = [
        (
            t,
            name,
            text.replace(
                '"step": 10, "fingerprint": "' + "00" * 32,
                '"step": 9, "fingerprint": "' + "00" * 32,
            ),
        )
        for t, name, text in run.lines
    ]
    report = build_report(run.write_until())
    assert report["invariants"]["I1"]["ok"] is True
    assert report["replicas"]["r1"]["final_step"] == 9


def test_i2_gap_is_reported(tmp_path: Path) -> None:
    run = SyntheticRun(tmp_path, span_override={(5, "r2"): [48, 56]})
    report = build_report(run.write_until())
    i2 = report["invariants"]["I2"]
    assert i2["ok"] is False
    assert "r2: gap: positions [40, 48)" in i2["detail"]


def test_i2_overlap_is_reported(tmp_path: Path) -> None:
    run = SyntheticRun(tmp_path, span_override={(7, "r1"): [24, 32]})
    i2 = build_report(run.write_until())["invariants"]["I2"]
    assert i2["ok"] is False
    assert i2["detail"].startswith("r1: overlap: step 7 [24, 32)")


def test_loggers_disagreeing_is_an_inconsistency(tmp_path: Path) -> None:
    run = SyntheticRun(tmp_path)
    # Only r2's own line claims a different range for r2 in step 8.
    run.lines = [
        (t, name, text.replace('"r2": [64, 72]', '"r2": [64, 73]'))
        if name == "replicas/r2.jsonl"
        else (t, name, text)
        for t, name, text in run.lines
    ]
    report = build_report(run.write_until())
    (item,) = report["inconsistencies"]
    assert item == {
        "kind": "range",
        "step": 8,
        "replica": "r2",
        "loggers": {"r0": [64, 72], "r2": [64, 73]},
    }
    assert report["invariants"]["I2"]["ok"] is False


def test_truncated_last_line_and_unknown_events_are_tolerated(run_dir: Path) -> None:
    with (run_dir / "replicas" / "r0.jsonl").open("a") as f:
        f.write('{"t": 1013.0, "event": "heartbeat", "replica": "r0"}\n{"t": 1013.1, "ev')
    log = RunLog.load(run_dir)
    assert len(log.skipped) == 1
    assert "unreadable" in log.skipped[0]
    assert len(log.commits("r0")) == 10


def test_bad_field_type_raises_with_location(run_dir: Path) -> None:
    with (run_dir / "replicas" / "r0.jsonl").open("a") as f:
        f.write('{"t": 1013.0, "event": "commit", "replica": "r0", "step": "7"}\n')
    with pytest.raises(ValueError, match=r"r0\.jsonl:\d+: field 'step'"):
        RunLog.load(run_dir)


def test_tail_reads_only_appended_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == []
    path.write_text('{"t": 1, "event": "end"}\n{"t": 2, "ev')
    assert len(tail.poll()) == 1
    with path.open("a") as f:
        f.write('ent": "end"}\n')
    (event,) = tail.poll()
    assert event.t == 2.0
    assert tail.poll() == []


def test_write_report_writes_json(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    report = write_report(run_dir, out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))


def test_missing_run_dir_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build_report(tmp_path / "nope")


@pytest.mark.parametrize("reached_again", [7, 5])
def test_a_restart_of_every_replica_from_the_durable_checkpoint_is_a_rollback(
    tmp_path: Path, reached_again: int
) -> None:
    """All three replicas die after committing step 5 and go on from the checkpoint of step 3
    (no launcher rollback event: restart policy `replica`); r0 and r1 train steps 3-5 again
    without r2, which catches up at step 6. The first run of steps 3-5 is history no more: I2
    holds and nothing is an inconsistency. So too when the first run had gone further than the
    second one gets before the run ends (`reached_again` 5: its steps 6-7 are thrown away
    too, never trained again)."""
    lines: list[tuple[float, str, dict[str, Any]]] = []
    positions = dict.fromkeys(ALL, 0)

    def commit(t: float, step: int, loggers: list[str], contributing: list[str]) -> None:
        trained = {}
        for r in contributing:
            trained[r] = [positions[r], positions[r] + SPS]
            positions[r] += SPS
        for r in loggers:
            recovered = r not in contributing
            lines.append((t, r, {"event": "commit", "step": step, "quorum_id": 1,
                                 "healthy": contributing, "recovered": recovered,
                                 "trained": trained, "loss": 1.0, "tokens": 0,
                                 "attempts": 1, "seconds": {}}))  # fmt: skip

    for r in ALL:
        lines.append((T0, r, {"event": "start", "incarnation": 0, "step": 0}))
    first_run = 6 if reached_again == 7 else 8
    for step in range(first_run):
        commit(T0 + 1 + step, step, ALL, ALL)
    positions = dict.fromkeys(ALL, 3 * SPS)  # the durable checkpoint of step 3
    for r in ALL:
        lines.append((T0 + 10, r, {"event": "start", "incarnation": 1, "step": 3}))
    for step in (3, 4, 5):
        commit(T0 + 11 + step, step, ["r0", "r1"], ["r0", "r1"])
    if reached_again == 7:
        commit(T0 + 17, 6, ALL, ["r0", "r1"])  # r2 catches up
        commit(T0 + 18, 7, ALL, ALL)
    (tmp_path / "replicas").mkdir()
    sup = [{"t": T0, "event": "run", "replicas": ALL, "world_size": 1, "kill_every_s": 5.0,
            "kill_mode": "process", "seed": 0, "samples_per_step": SPS, "total_replicas": 3},
           {"t": T0 + 20, "event": "end"}]  # fmt: skip
    (tmp_path / "supervisor.jsonl").write_text("".join(json.dumps(e) + "\n" for e in sup))
    for r in ALL:
        mine = [{"t": t, "replica": r, **e} for t, who, e in lines if who == r]
        text = "".join(json.dumps(e) + "\n" for e in sorted(mine, key=lambda e: e["t"]))
        (tmp_path / "replicas" / f"{r}.jsonl").write_text(text)
    report = build_report(tmp_path)
    assert report["inconsistencies"] == []
    assert report["invariants"]["I2"]["ok"], report["invariants"]["I2"]
    # Steps 3-5 (and 6-7 when never reached again) of r0, r1 and r2.
    assert report["summary"]["rolled_back_replica_steps"] == 3 * (first_run - 3)
