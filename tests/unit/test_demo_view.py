"""The live view: states derived from the logs as they grow, read incrementally."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from rich.console import Console

from fthsdp.deploy.demo.view import LiveView, run_live, run_progress
from tests.unit.test_demo_report import T0, SyntheticRun


def _text(view: LiveView, now: float) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(view.render(now=now))
    return console.file.getvalue()  # type: ignore[attr-defined]


def _row(text: str, replica: str) -> list[str]:
    line = next(line for line in text.splitlines() if f" {replica} " in line)
    return [cell.strip() for cell in line.strip("│┃ ").split("│")]


def test_states_follow_the_run(tmp_path: Path) -> None:
    run = SyntheticRun(tmp_path)
    view = LiveView(run.write_until(T0 + 4.55), ["r0", "r1", "r2"])
    text = _text(view, T0 + 4.55)
    # replica, step, state, quorum, loss, tokens/s
    assert _row(text, "r0") == ["r0", "4", "healthy", "1", "2.700", "512"]
    assert _row(text, "r1")[:3] == ["r1", "4", "down"]
    assert "failures injected 1" in text
    assert "quorum #1" in text
    assert "elapsed    4.5s" in text

    run.write_until(T0 + 7.2)
    text = _text(view, T0 + 7.2)
    assert _row(text, "r1")[:4] == ["r1", "4", "recovering", "-"]
    assert "quorum #2 healthy r0,r2 max_step 4" in text
    # The survivors' stall shows in the recent throughput: steps 0-4 commit over 5.5 s.
    assert _row(text, "r0")[5] == "372"  # 4 x 512 tokens over 5.5 s

    run.write_until(T0 + 8.6)
    row = _row(_text(view, T0 + 8.6), "r1")
    assert row[:4] == ["r1", "7", "recovering", "3"]
    assert row[4] == "-"

    run.write_until(T0 + 11.0)
    text = _text(view, T0 + 11.0)
    assert _row(text, "r1")[:3] == ["r1", "9", "healthy"]
    assert _row(text, "r2")[:3] == ["r2", "9", "healthy"]

    run.write_until()
    with (tmp_path / "supervisor.jsonl").open("a") as f:
        f.write('{"t": 1012.5, "event": "exit", "replica": "r0", "rank": 0, "code": 0}\n')
    text = _text(view, T0 + 13.0)
    assert _row(text, "r0")[:3] == ["r0", "10", "finished"]


def test_reads_incrementally(tmp_path: Path) -> None:
    run = SyntheticRun(tmp_path)
    view = LiveView(run.write_until(T0 + 3.5), ["r0", "r1", "r2"])
    view.poll()
    r0_log = tmp_path / "replicas" / "r0.jsonl"
    # Bytes already consumed are never parsed again: rewriting them unseen changes nothing.
    size = r0_log.stat().st_size
    r0_log.write_bytes(b"x" * size)
    run.write_until()
    text = _text(view, T0 + 12.0)
    assert _row(text, "r0")[:3] == ["r0", "10", "finished"]
    assert view._tails["r0"].skipped == []


def test_a_replica_without_logs_is_starting(tmp_path: Path) -> None:
    view = LiveView(tmp_path, ["r0"])
    text = _text(view, 0.0)
    assert _row(text, "r0")[:3] == ["r0", "-", "starting"]
    assert "quorum none yet" in text


def test_run_live_prints_plain_lines_when_not_a_terminal(tmp_path: Path) -> None:
    run_dir = SyntheticRun(tmp_path).write_until()
    out = io.StringIO()
    stop = threading.Event()
    stop.set()
    run_live(LiveView(run_dir, ["r0", "r1"]), stop, console=Console(file=out, width=200))
    (line,) = out.getvalue().splitlines()
    assert line.startswith("r0 10 finished | r1 10 finished | elapsed")


def test_run_live_draws_on_a_terminal(tmp_path: Path) -> None:
    run_dir = SyntheticRun(tmp_path).write_until(T0 + 9.9)
    out = io.StringIO()
    stop = threading.Event()
    timer = threading.Timer(0.15, stop.set)
    timer.start()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    run_live(LiveView(run_dir, ["r0"]), stop, refresh_s=0.05, console=console)
    timer.join()
    assert "healthy" in out.getvalue()


def test_progress_lines_give_each_replica_step_loss_state_and_restarts(tmp_path: Path) -> None:
    run = SyntheticRun(tmp_path)
    view = LiveView(run.write_until(T0 + 8.6), ["r0", "r1", "r2"])
    assert view.progress_lines() == [
        "progress replica=r0 step=7 loss=2.400 state=healthy restarts=0",
        # Restarted once at T0 + 6.9, and its new incarnation has no loss of its own yet.
        "progress replica=r1 step=7 loss=- state=recovering restarts=1",
        "progress replica=r2 step=7 loss=2.400 state=healthy restarts=0",
    ]
    run.write_until()
    assert view.progress_lines()[1] == (
        "progress replica=r1 step=10 loss=2.100 state=finished restarts=1"
    )


def test_run_progress_prints_one_line_per_replica_each_period(tmp_path: Path) -> None:
    run_dir = SyntheticRun(tmp_path).write_until()
    stop = threading.Event()

    class Out(io.StringIO):
        """Stops the printer once it has printed twice (no timing involved)."""

        def flush(self) -> None:
            if self.getvalue().count("replica=r1") == 2:
                stop.set()

    out = Out()
    run_progress(LiveView(run_dir, ["r0", "r1"]), stop, 0.01, out=out)
    lines = out.getvalue().splitlines()
    assert lines == 2 * [
        "progress replica=r0 step=10 loss=2.100 state=finished restarts=0",
        "progress replica=r1 step=10 loss=2.100 state=finished restarts=1",
    ]
