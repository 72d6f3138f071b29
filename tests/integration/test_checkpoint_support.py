"""Fixtures and fault injectors for the checkpoint tests: embedded and spawned sidecars, a state of
every allowed dtype, and a TCP proxy that can cut connections or fire a callback mid-stream.

The proxy's own behaviour is tested here, so a fault test can trust what it injects."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from fthsdp.services.checkpoint.config import CheckpointConfig
from fthsdp.services.checkpoint.server import CheckpointServer
from fthsdp.services.common.tokens import Token

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 * 1024
JOB = "job"


def make_state(seed: int = 0, scale: int = 1) -> dict[str, torch.Tensor]:
    """Every allowed dtype, 0-d and empty tensors, a non-contiguous one, sizes across chunks."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        "w": torch.randn(300 * scale, 129, generator=gen),
        "w64": torch.randn(1000, generator=gen, dtype=torch.float64),
        "h": torch.randn(77, 3, generator=gen).half(),
        "bf": torch.randn(50_000 * scale, generator=gen).bfloat16(),
        "i64": torch.randint(-(2**62), 2**62, (999,), generator=gen),
        "i32": torch.randint(-(2**31), 2**31 - 1, (5, 7), generator=gen, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (33,), generator=gen, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (17,), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (70_001,), generator=gen, dtype=torch.uint8),
        "mask": torch.rand(1234, generator=gen) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.bfloat16),
        "step": torch.tensor(7 + seed, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(40, 60, generator=gen).t(),
    }
    return state


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        a = got[name].contiguous().reshape(-1).view(torch.uint8)
        b = tensor.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), name


def sidecar_config(root: Path, **overrides: object) -> CheckpointConfig:
    values: dict[str, object] = {
        "shm_dir": root / "shm",
        "durable_root": root / "durable",
        "chunk_bytes": CHUNK,
        "max_range_bytes": 16 * CHUNK,
        "stream_bytes": CHUNK,
        "checksum_wait": timedelta(seconds=5),
        "shutdown_grace": timedelta(seconds=1),
        "checksum_threads": 1,
    }
    values.update(overrides)
    return CheckpointConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def sidecars(tmp_path: Path, token: str) -> Iterator[Callable[..., CheckpointServer]]:
    """Starts embedded sidecars on port 0 (each in its own dirs unless `root` is given)."""
    started: list[CheckpointServer] = []

    def start(name: str = "", root: Path | None = None, **overrides: object) -> CheckpointServer:
        server = CheckpointServer(
            sidecar_config(root or tmp_path / (name or f"s{len(started)}"), **overrides),
            Token(token),
        )
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


class SpawnedSidecar:
    """A sidecar in its own process (`python -m fthsdp.services.checkpoint`), for real kills."""

    def __init__(self, root: Path, token: str, *extra: str) -> None:
        self.shm_dir = root / "shm"
        self.durable_root = root / "durable"
        env = dict(os.environ, FTHSDP_TOKEN=token, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "fthsdp.services.checkpoint", "--port", "0", "--nice", "0"]
        cmd += ["--shm-dir", str(self.shm_dir), "--durable-dir", str(self.durable_root)]
        cmd += ["--chunk-bytes", str(CHUNK), "--max-range-bytes", str(16 * CHUNK), *extra]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.url = line.rsplit(" ", 1)[1].strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def spawn(tmp_path: Path, token: str) -> Iterator[Callable[..., SpawnedSidecar]]:
    spawned: list[SpawnedSidecar] = []

    def start(name: str, *extra: str) -> SpawnedSidecar:
        sidecar = SpawnedSidecar(tmp_path / name, token, *extra)
        spawned.append(sidecar)
        return sidecar

    yield start
    for sidecar in spawned:
        sidecar.kill()


class Proxy:
    """A TCP proxy to `upstream`: can cut each connection after `cut_after` downstream bytes, or go
    silent after `stall_after` (holding the connection open until `close`), and calls
    `on_total(total)` as downstream bytes flow (to kill the upstream mid-stream)."""

    def __init__(
        self,
        upstream: str,
        *,
        cut_after: int | None = None,
        stall_after: int | None = None,
        on_total: Callable[[int], None] | None = None,
    ) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.cut_after = cut_after
        self.stall_after = stall_after
        self.stalls = 0
        self._released = threading.Event()
        self.on_total = on_total
        self.total = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if downstream and self.cut_after is not None and sent + len(data) > self.cut_after:
                    dst.sendall(data[: self.cut_after - sent])
                    with self._lock:
                        self.cuts += 1
                    break
                if (
                    downstream
                    and self.stall_after is not None
                    and sent + len(data) > self.stall_after
                ):
                    dst.sendall(data[: self.stall_after - sent])
                    with self._lock:
                        self.stalls += 1
                    self._released.wait()
                    break
                dst.sendall(data)
                if downstream:
                    sent += len(data)
                    with self._lock:
                        self.total += len(data)
                        total = self.total
                    if self.on_total is not None:
                        self.on_total(total)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._closed = True
        self._released.set()
        self._sock.close()


def test_proxy_forwards_and_cuts() -> None:
    echo = socket.create_server(("127.0.0.1", 0))
    port = echo.getsockname()[1]

    def serve() -> None:
        conn, _ = echo.accept()
        conn.recv(16)
        conn.sendall(b"x" * 100_000)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    seen: list[int] = []
    proxy = Proxy(f"http://127.0.0.1:{port}", cut_after=1000, on_total=seen.append)
    host, proxy_port = proxy.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(proxy_port))) as sock:
        sock.sendall(b"hello")
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    proxy.close()
    echo.close()
    assert got == b"x" * 1000
    assert proxy.cuts == 1
    assert all(total <= 1000 for total in seen)
