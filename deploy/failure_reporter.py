"""Tells the quorum service which of `fthsdp up`'s replicas died, from a child process.

`up` starts children with a pre-exec step (Linux's parent-death signal), which is unsafe in a
process running gRPC's threads, so its gRPC client lives here instead: one line in on stdin per
failure (`<replica id>\\t<reason>`), one line out (`<replica id>`) once the report was made or
given up (the replica's heartbeat timeout evicts it then). `FailureReporter` is `up`'s side:
it starts this child, restarts it if it dies, and reads its acknowledgements without blocking.

    python -m fthsdp.deploy.failure_reporter     # FTHSDP_QUORUM, FTHSDP_TOKEN_FILE from the env
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

log = logging.getLogger(__name__)

REPORTER = "fthsdp-up"
"""How the quorum service's log names the reports."""
_MAX_LINE = 4096


class FailureReporter:
    """`up`'s handle on the reporter child."""

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        self._env = dict(env)
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending = b""

    def send(self, replica_id: str, reason: str) -> None:
        """Asks for `replica_id`'s eviction; its id comes back from `acknowledged` when done."""
        line = f"{replica_id}\t{' '.join(reason.split())}"[:_MAX_LINE] + "\n"
        for attempt in (1, 2):  # a child that died is started again once
            proc = self._running()
            assert proc.stdin is not None
            try:
                proc.stdin.write(line.encode())
                proc.stdin.flush()
                return
            except BrokenPipeError:
                self._proc = None
                if attempt == 2:
                    log.warning(
                        "the failure reporter is gone; %s is left to its timeout", replica_id
                    )

    def acknowledged(self) -> list[str]:
        """Replica ids whose reports are done since the last call."""
        if self._proc is None or self._proc.stdout is None:
            return []
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self._proc.stdout.fileno(), 65536):
                self._pending += chunk
        *done, self._pending = self._pending.split(b"\n")
        return [line.decode(errors="replace") for line in done if line]

    def stop(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _running(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self.stop()
        with self._log_path.open("ab") as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "fthsdp.deploy.failure_reporter"],
                env=self._env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=out,
            )
        assert self._proc.stdout is not None
        os.set_blocking(self._proc.stdout.fileno(), False)
        return self._proc


def main() -> int:
    from fthsdp.services.common.tokens import load_token
    from fthsdp.services.quorum.client import QuorumClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s failure_reporter: %(message)s")
    token = load_token(env=dict(os.environ)).value
    client = QuorumClient(os.environ["FTHSDP_QUORUM"], token, connect_timeout=timedelta(seconds=2))
    try:
        for line in sys.stdin:
            replica_id, _, reason = line.rstrip("\n").partition("\t")
            try:
                client.report_failure(replica_id, reason, reporter=REPORTER)
                log.info("reported %s: %s", replica_id, reason)
            except Exception as exc:  # its heartbeat timeout evicts it anyway
                log.warning("report_failure(%s) failed: %s", replica_id, exc)
            print(replica_id, flush=True)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
