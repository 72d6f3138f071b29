"""The launcher's side of warm spares: a pool of rank processes waiting for an identity.

Each spare runs the rank's command with `FTHSDP_SPARE_FDS` naming two inherited pipe ends (see
`fthsdp.worker.spare`): it says "warm" on one once it waits, and reads its identity from the
other. `take` hands out the oldest (the warmest) and `Spare.hand_over` writes the identity;
closing the identity pipe without one makes a spare exit, so spares never outlive the launcher
that stops its pool (and a launcher that dies closes the pipes with it)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from fthsdp.worker.spare import SPARE_FDS_ENV, Identity

log = logging.getLogger(__name__)

DISMISS_GRACE_S = 0.5
"""How long a released spare has to exit by itself before a kill: a waiting one reads EOF at
once; one still warming up (importing, building its model) would read it only when done."""


class Spare:
    """One spare process and the launcher's ends of its two pipes."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        identity_r, self._identity_w = os.pipe()
        self._ready_r, ready_w = os.pipe()
        try:
            with log_path.open("ab") as out:
                self.proc = subprocess.Popen(
                    list(argv),
                    env={**env, SPARE_FDS_ENV: f"{identity_r},{ready_w}"},
                    pass_fds=(identity_r, ready_w),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    preexec_fn=preexec,
                )
        except BaseException:
            os.close(self._identity_w)
            os.close(self._ready_r)
            raise
        finally:
            os.close(identity_r)
            os.close(ready_w)
        os.set_blocking(self._ready_r, False)
        self.warm = False
        """Whether it said it waits for an identity (remembered once seen)."""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_warm(self) -> bool:
        """Whether it is ready now (reads its ready pipe without blocking)."""
        if not self.warm and self._ready_r >= 0:
            with contextlib.suppress(BlockingIOError):  # nothing yet
                self.warm = bool(os.read(self._ready_r, 64))
        return self.warm and self.alive()

    def hand_over(self, identity: Identity) -> None:
        """Makes it the rank `identity` names; a spare that died meanwhile is reaped like any
        rank by whoever took it."""
        data = identity.encode()
        self._close_ready()
        try:
            os.write(self._identity_w, data)  # < PIPE_BUF-sized in practice; a pipe holds 64 KiB
        except OSError as exc:
            log.warning("could not hand spare %d its identity: %s", self.proc.pid, exc)
        finally:
            self._close_identity()

    def release(self) -> None:
        """Closes its pipes: a waiting spare exits by itself."""
        self._close_identity()
        self._close_ready()

    def dismiss(self, grace_s: float = DISMISS_GRACE_S) -> None:
        """Ends it: released, given `grace_s` to exit, then killed. Reaped before returning."""
        self.release()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _close_identity(self) -> None:
        if self._identity_w >= 0:
            os.close(self._identity_w)
            self._identity_w = -1

    def _close_ready(self) -> None:
        if self._ready_r >= 0:
            os.close(self._ready_r)
            self._ready_r = -1


class SparePool:
    """Keeps `size` spare processes running (oldest first: the warmest); `take` hands them out."""

    def __init__(
        self,
        size: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_dir: Path,
        *,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        if size < 0:
            raise ValueError("the spare pool size must not be negative")
        self.size = size
        self._argv = list(argv)
        self._env = dict(env)
        self._log_dir = log_dir
        self._preexec = preexec
        self._spares: list[Spare] = []
        self._started = 0
        self.taken = 0
        """Spares handed out so far."""

    @property
    def warm(self) -> int:
        """Spares ready to take over now."""
        return sum(1 for spare in self._spares if spare.check_warm())

    def refill(self) -> None:
        """Forgets spares that died and starts a new one when the pool is short, one at a
        time: a spare warming up takes a core for seconds, and on a small host several at once
        would starve the training ranks (their heartbeats, their steps)."""
        self._reap()
        if len(self._spares) >= self.size or any(not s.check_warm() for s in self._spares):
            return
        self._started += 1
        log_path = self._log_dir / f"spare-{self._started}.log"
        self._spares.append(Spare(self._argv, self._env, log_path, self._preexec))

    def take(self, n: int) -> list[Spare] | None:
        """`n` spares, the oldest first, or None (and none taken) if fewer are alive."""
        self._reap()
        if n < 1 or len(self._spares) < n:
            return None
        taken, self._spares = self._spares[:n], self._spares[n:]
        self.taken += n
        return taken

    def stop(self) -> None:
        """Ends every spare still in the pool (released together, then each given what is left
        of one grace period)."""
        for spare in self._spares:
            spare.release()
        deadline = time.monotonic() + DISMISS_GRACE_S
        for spare in self._spares:
            spare.dismiss(max(0.0, deadline - time.monotonic()))
        self._spares = []

    def _reap(self) -> None:
        for spare in self._spares:
            if not spare.alive():
                spare.dismiss(0.0)
        self._spares = [spare for spare in self._spares if spare.alive()]
