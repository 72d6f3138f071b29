"""A snapshot that does not fit in the host's shared memory: the publish fails with ENOSPC, the
rank lives on and trains on (I4: serving is best effort), and no file is left behind.

The publisher used to size a sparse tmpfs file and map it: on a full tmpfs the copy then met a
page the kernel could not allocate, and the rank died of SIGBUS. It allocates the file's pages
before mapping them now. Needs root: each test mounts a 1 MiB tmpfs of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from fthsdp.services.checkpoint.client import list_snapshots
from fthsdp.services.checkpoint.server import CheckpointServer
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.peer_state import PeerState
from tests.integration.test_checkpoint_support import JOB, ROOT, sidecars

__all__ = ["sidecars"]
pytestmark = pytest.mark.timeout(60)

SMALL = {"w": torch.arange(1000, dtype=torch.float32)}
"""4 KB: fits."""
LARGE = {"w": torch.ones(1 << 20)}
"""4 MiB: does not fit in the 1 MiB tmpfs."""


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A private 1 MiB tmpfs, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "shm"
    path.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_publish_that_does_not_fit_raises_enospc_and_the_process_lives(
    small_shm: Path, token: str
) -> None:
    # In a child process: before the fix the copy's SIGBUS killed whoever published.
    script = (
        "import errno, sys, torch\n"
        "from fthsdp.services.checkpoint.client import SnapshotPublisher\n"
        "pub = SnapshotPublisher('http://127.0.0.1:9', sys.argv[2], job='j', replica_id='r0',\n"
        "                        rank=0, shm_dir=sys.argv[1])\n"
        "try:\n"
        "    pub.publish(1, {'w': torch.ones(1 << 20)}, {'step': 1})\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode.get(exc.errno))\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(small_shm), token],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=50,
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.strip() == "ENOSPC", child.stdout
    assert list(small_shm.iterdir()) == []  # the file it began is gone


def test_a_rank_whose_snapshot_does_not_fit_serves_nothing_and_trains_on(
    small_shm: Path, sidecars: Callable[..., CheckpointServer], token: str
) -> None:
    server = sidecars(shm_dir=small_shm)
    config = ManagerConfig(
        job_id=JOB,
        replica_id="r0",
        replica_index=0,
        total_replicas=2,
        quorum_address="127.0.0.1:9",  # never asked: only the sidecar is
        checkpoint_url=server.url,
        token=token,
        shm_dir=str(small_shm),
    )
    peers = PeerState(config=config, rank=0, world_size=1)
    peers.publish(3, dict(LARGE), {"step": 3})  # logged, not raised: the step goes on
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == []
    assert list(small_shm.iterdir()) == []
    peers.publish(4, dict(SMALL), {"step": 4})  # a later, smaller state is served
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == [4]
