"""The fthsdp control plane as local processes: the embedded default for one machine.

The quorum service runs inside this process (on its own event-loop thread); each checkpoint
sidecar is its own process, one per simulated host, so serving state never competes with the
launcher or with training for the interpreter lock."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import httpx

from services.common.tokens import load_token
from services.quorum.client import QuorumClient
from services.quorum.config import QuorumConfig
from services.quorum.server import QuorumServerThread
from services.quorum.store import InMemoryStore, clock_epoch_floor

log = logging.getLogger(__name__)


def _free_port() -> int:
    from deploy.demo.supervisor import free_port

    return free_port()


class Sidecar:
    """One checkpoint sidecar process."""

    def __init__(
        self, *, name: str, run_dir: Path, token_file: Path, shm_dir: Path, durable_dir: Path
    ) -> None:
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.shm_dir = shm_dir
        self._argv = [
            sys.executable, "-m", "services.checkpoint",
            "--port", str(self.port),
            "--shm-dir", str(shm_dir),
            "--durable-dir", str(durable_dir),
            "--token-file", str(token_file),
        ]  # fmt: skip
        self._log = run_dir / "logs" / f"checkpoint-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with self._log.open("ab") as out:
            self.proc = subprocess.Popen(self._argv, stdout=out, stderr=out)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"checkpoint sidecar {self.name} exited; see {self._log}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"checkpoint sidecar {self.name} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LocalStack:
    """Quorum service + checkpoint sidecars, started together and stopped together."""

    def __init__(
        self,
        *,
        run_dir: Path,
        token_file: Path,
        hosts: list[str],
        checkpoint_dir: Path,
        heartbeat_timeout: timedelta = timedelta(seconds=1),
        join_timeout: timedelta = timedelta(seconds=2),
        min_replicas: int = 1,
        shm_root: Path = Path("/dev/shm"),
    ) -> None:
        self._token = load_token(path=str(token_file))
        self._quorum_config = QuorumConfig(
            port=0,
            admin_port=0,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            min_replicas=min_replicas,
        )
        self._quorum: QuorumServerThread | None = None
        shm = shm_root / f"fthsdp-{run_dir.resolve().name}-{int(time.time())}"
        self._shm = shm
        self.sidecars = {
            host: Sidecar(
                name=host,
                run_dir=run_dir,
                token_file=token_file,
                shm_dir=shm / host,
                durable_dir=checkpoint_dir,
            )
            for host in hosts
        }
        self.quorum_address = ""

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self.start_quorum()
        for sidecar in self.sidecars.values():
            sidecar.start()
        for sidecar in self.sidecars.values():
            sidecar.wait_ready(timeout=60)

    def start_quorum(self, port: int | None = None) -> None:
        """Starts the quorum service (again, on the same port, after `stop_quorum`)."""
        config = self._quorum_config
        if port is not None:
            config = dataclasses.replace(config, port=port)
        # A fresh in-memory store each start, as after a real restart; its epochs begin above
        # the wall clock so quorum ids never go back (I3).
        store = InMemoryStore(history_size=config.history_size, epoch_floor=clock_epoch_floor())
        self._quorum = QuorumServerThread(config, self._token, store=store)
        self.quorum_address = self._quorum.start()

    def restart_quorum(self) -> None:
        """Stops the quorum service and starts a fresh one on the same port: with the in-memory
        store it forgets every replica, which must rejoin by themselves."""
        port = int(self.quorum_address.rsplit(":", 1)[1])
        self.stop_quorum()
        self.start_quorum(port=port)

    def stop_quorum(self) -> None:
        if self._quorum is not None:
            self._quorum.stop()
            self._quorum = None

    def quorum_client(self) -> QuorumClient:
        return QuorumClient(self.quorum_address, self._token.value)

    def report_failure(self, replica_id: str, reason: str) -> None:
        """Evicts a replica at once (the supervisor saw its process die)."""
        client = self.quorum_client()
        try:
            client.report_failure(replica_id, reason, reporter="supervisor")
        except Exception as exc:  # the heartbeat timeout evicts it anyway
            log.warning("report_failure(%s) failed: %s", replica_id, exc)
        finally:
            client.close()

    def stop(self) -> None:
        for sidecar in self.sidecars.values():
            sidecar.stop()
        self.stop_quorum()
        # Snapshots live in RAM; whatever a killed rank left behind goes with the stack.
        shutil.rmtree(self._shm, ignore_errors=True)
