"""A local redis-server (on 127.0.0.1, or another address of this host): a free port, a
private data directory with an fsync'd append-only file, a password; killable (SIGKILL, a
crash) and restartable on the same port with its data. The demo's failover mode, the
benchmarks and the tests start Redis through it; `scripts/bootstrap.sh` installs redis-server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from fthsdp.deploy.processes import free_port


def redis_binary() -> str | None:
    """The redis-server executable, or None when it is not installed."""
    return shutil.which("redis-server")


class LocalRedis:
    """One redis-server process on `host` (default 127.0.0.1) with persistence in `directory`."""

    def __init__(
        self, directory: Path, *, password: str | None = None, host: str = "127.0.0.1"
    ) -> None:
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/bootstrap.sh installs it)")
        self._binary = binary
        self.directory = directory
        self.password = password
        self.host = host
        self.port = free_port(host)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis:// URL of this server (with the password when one is set)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Starts (or restarts) the server on the same port and data directory."""
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [
            self._binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.password:
            argv += ["--requirepass", self.password]
        log = (self.directory / "redis.log").open("ab")
        self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited: see {self.directory / 'redis.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not answer PING in time")
            time.sleep(0.02)

    def running(self) -> bool:
        """Whether the process is up (started and not exited)."""
        return self._process is not None and self._process.poll() is None

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                if self.password:
                    sock.sendall(f"AUTH {self.password}\r\n".encode())
                    sock.recv(64)
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: a crash; what was fsynced to the append-only file survives a restart."""
        if self._process is not None and self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()

    def stop(self) -> None:
        """Terminates the server (idempotent)."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
