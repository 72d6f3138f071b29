"""A service started with `--log-format json` writes nothing but JSON lines to stderr, with the
`extra` context of each line as fields: the quorum service, and the checkpoint sidecar, whose
HTTP server (uvicorn) logs through the same handler instead of its own text format."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


class _Stderr:
    """The child's stderr, line by line, read on a thread so that waits have a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        stream = proc.stderr

        def read() -> None:
            for line in stream:
                self._queue.put(line)
            self._queue.put(None)

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def wait_for(self, found: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """The first JSON line `found` accepts (read before or now). A line that is not JSON
        fails the test, and so do the end of the stream and the deadline."""
        for seen in self.lines:
            if found(json.loads(seen)):
                return dict(json.loads(seen))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            assert line is not None, f"stderr ended; so far: {self.lines}"
            self.lines.append(line)
            record = json.loads(line)  # every line: a JSON object
            assert isinstance(record, dict), line
            if found(record):
                return record
        raise AssertionError(f"no such line within {timeout_s} s; so far: {self.lines}")

    def rest(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every remaining line (the child has exited), each parsed."""
        self._reader.join(timeout_s)
        out = []
        while not self._queue.empty():
            line = self._queue.get_nowait()
            if line is not None:
                self.lines.append(line)
                out.append(json.loads(line))
        return out


def _spawn(argv: list[str], token: str) -> subprocess.Popen[str]:
    # gRPC's C core writes its own lines to stderr; only errors are expected here.
    env = {**os.environ, "FTHSDP_TOKEN": token, "GRPC_VERBOSITY": "ERROR"}
    env.pop("FTHSDP_LOG_FORMAT", None)
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def _assert_shape(record: dict[str, Any]) -> None:
    assert {"ts", "level", "logger", "msg"} <= record.keys(), record
    assert record["ts"].endswith("+00:00"), record
    assert "color_message" not in record  # uvicorn's terminal copy of the message


@pytest.mark.timeout(60)
def test_quorum_service_writes_json_lines_with_their_context(token: str) -> None:
    proc = _spawn(
        [
            "-m",
            "fthsdp.services.quorum",
            "--port",
            "0",
            "--admin-port",
            "-1",
            "--log-format",
            "json",
        ],
        token,
    )
    try:
        err = _Stderr(proc)
        listening = err.wait_for(lambda r: r["msg"] == "quorum service listening", 30)
        _assert_shape(listening)
        assert listening["level"] == "INFO"
        assert listening["logger"].startswith("fthsdp.services.quorum")
        assert listening["address"].startswith("127.0.0.1:")  # the `extra` context
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        rest = err.rest(10)
        assert any(r["msg"] == "quorum service stopped" for r in rest), err.lines
        for record in rest:
            _assert_shape(record)
    finally:
        _stop(proc)


@pytest.mark.timeout(60)
def test_checkpoint_sidecar_and_its_http_server_write_json_lines(
    token: str, tmp_path: Path
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    proc = _spawn(
        [
            "-m", "fthsdp.services.checkpoint",
            "--port", "0",
            "--shm-dir", str(shm),
            "--durable-dir", str(tmp_path / "durable"),
            "--nice", "0",
            "--log-level", "info",
            "--log-format", "json",
        ],
        token,
    )  # fmt: skip
    try:
        err = _Stderr(proc)
        serving = err.wait_for(lambda r: r["msg"].startswith("checkpoint sidecar serving"), 30)
        _assert_shape(serving)
        # uvicorn's own startup line, in the same format rather than uvicorn's text.
        err.wait_for(lambda r: r["logger"].startswith("uvicorn"), 30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        for record in err.rest(10):
            _assert_shape(record)
    finally:
        _stop(proc)
