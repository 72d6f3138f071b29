"""Warm spare rank processes for the demo's launcher.

A spare is a rank process started with `--spare`: it imports torch and builds the model (the
seconds a fresh process spends before it can take part), then blocks reading its identity from
stdin. Taking it over writes that identity (the flags that make it rank i of replica r, one JSON
list) and closes the pipe; from then on it is an ordinary rank, a new incarnation of its
replica that catches up from its peers as any restart does (I1-I6 are unchanged). A spare whose
stdin closes without an identity exits: spares never outlive the launcher."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class SparePool:
    """Keeps `size` spare processes running (oldest first: the warmest); `take` hands them out."""

    def __init__(
        self, size: int, argv: Sequence[str], env: Mapping[str, str], log_dir: Path
    ) -> None:
        if size < 0:
            raise ValueError("the spare pool size must not be negative")
        self.size = size
        self._argv = list(argv)
        self._env = dict(env)
        self._log_dir = log_dir
        self._procs: list[subprocess.Popen[bytes]] = []
        self._started = 0
        self.taken = 0
        """Spares handed out so far."""
        self._warm: set[int] = set()
        """Pids of spares that said they are ready."""

    @property
    def warm(self) -> int:
        """Spares ready to take over now."""
        return sum(1 for proc in self._procs if proc.poll() is None and self._is_warm(proc))

    def refill(self) -> None:
        """Forgets spares that died and starts a new one when the pool is short, one at a
        time: a spare warming up takes a core for seconds, and on a small host several at once
        would starve the training ranks (their heartbeats, their steps)."""
        self._procs = [proc for proc in self._procs if proc.poll() is None]
        if len(self._procs) >= self.size or any(not self._is_warm(p) for p in self._procs):
            return
        self._started += 1
        with (self._log_dir / f"spare-{self._started}.log").open("ab") as out:
            proc = subprocess.Popen(
                self._argv,
                env=self._env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # carries one line, "warm", then nothing
                stderr=out,
            )
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        self._procs.append(proc)

    def _is_warm(self, proc: subprocess.Popen[bytes]) -> bool:
        """Whether the spare said it is ready (its first stdout line); remembered once seen."""
        if proc.pid in self._warm:
            return True
        assert proc.stdout is not None
        try:
            said = bool(proc.stdout.read())
        except (BlockingIOError, ValueError):  # nothing yet; or the pipe is closed
            said = False
        if said:
            self._warm.add(proc.pid)
        return said

    def take(self, n: int) -> list[subprocess.Popen[bytes]] | None:
        """`n` spares, the oldest first, or None (and none taken) if fewer are alive."""
        self._procs = [proc for proc in self._procs if proc.poll() is None]
        if n < 1 or len(self._procs) < n:
            return None
        taken, self._procs = self._procs[:n], self._procs[n:]
        self._warm -= {proc.pid for proc in taken}
        self.taken += n
        return taken

    def stop(self) -> None:
        """Ends every spare: closing stdin is enough for a waiting one; kill the rest."""
        for proc in self._procs:
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs = []


def assign(proc: subprocess.Popen[bytes], identity: Sequence[str]) -> None:
    """Hands a taken spare its identity (the rest of its command line)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdout.close()  # it said "warm"; nothing more is read from it
    try:
        proc.stdin.write(json.dumps(list(identity)).encode() + b"\n")
        proc.stdin.close()
    except OSError as exc:  # it died meanwhile: the supervisor reaps it like any rank
        log.warning("could not hand a spare its identity: %s", exc)
