"""Reused shm segments and zero-copy serving, over real HTTP (uvicorn on port 0).

A publisher overwrites only segments the sidecar handed back; the sidecar hands one back only
when retention retired it and nobody reads it any more: a response whose client has not read it
yet, a checksum job, a durable write. These tests hold such readers and check the bytes they get
are the snapshot's, never a later step's."""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from fthsdp.services.checkpoint import client_publish
from fthsdp.services.checkpoint.client import (
    SnapshotPublisher,
    Source,
    fetch_snapshot,
    list_snapshots,
)
from fthsdp.services.checkpoint.server import CheckpointServer
from tests.integration.test_checkpoint_support import JOB, assert_bitwise_equal, sidecars

__all__ = ["sidecars"]
Start = Callable[..., CheckpointServer]
DEADLINE = timedelta(seconds=20)


def publisher(server: CheckpointServer, token: str) -> SnapshotPublisher:
    shm = server.config.shm_dir
    return SnapshotPublisher(server.url, token, job=JOB, replica_id="r0", rank=0, shm_dir=shm)


def state_of(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(100_000, generator=gen), "b": torch.randn(33, generator=gen).half()}


def fetch(server: CheckpointServer, token: str, step: int) -> dict[str, torch.Tensor]:
    got = fetch_snapshot(
        [Source(server.url, "r0")], job=JOB, rank=0, step=step, token=token, deadline=DEADLINE
    )
    return got.tensors


def names(shm: Path, suffix: str) -> list[str]:
    return sorted(p.name for p in shm.iterdir() if p.name.endswith(suffix))


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def served_then_handed_back(server: CheckpointServer, token: str, step: int) -> None:
    """Waits for `step`'s checksums (their job leases the file) so retention can hand back."""
    fetch(server, token, step)


@pytest.mark.parametrize("send_with", ["write", "sendfile"])
def test_segments_are_reused_and_every_step_reads_back_bitwise(
    sidecars: Start, token: str, send_with: str
) -> None:
    server = sidecars(retain_snapshots=2, send_with=send_with)
    shm = server.config.shm_dir
    pub = publisher(server, token)
    for step in range(1, 8):
        pub.publish(step, state_of(step), {"step": step})
        assert_bitwise_equal(fetch(server, token, step), state_of(step))
        assert len(list(shm.iterdir())) <= 3  # R served + the one being written
    # Steps 1-3 needed fresh segments (two served, none back yet); every later one reused one.
    assert pub.reused == 4
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == [6, 7]
    assert_bitwise_equal(fetch(server, token, 6), state_of(6))
    sample = server.services.metrics.zero_copy_bytes._value.get()  # type: ignore[attr-defined]
    assert sample > 0  # the bytes went out of the kernel directly, not through Python
    pub.close()
    server.stop()
    assert list(shm.iterdir()) == []


def test_a_response_the_client_has_not_read_keeps_its_segment(sidecars: Start, token: str) -> None:
    """sendfile queues the pages themselves: until the client read them, the publisher must not
    overwrite them, however far retention has moved on."""
    server = sidecars(retain_snapshots=1, send_with="sendfile")
    shm = server.config.shm_dir
    pub = publisher(server, token)
    pub.publish(1, state_of(1), {})
    manifest = fetch(server, token, 1)  # also waits for its checksums
    want = torch.cat([manifest["w"].view(torch.uint8), manifest["b"].view(torch.uint8)])
    size = 100_000 * 4
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    conn.request(
        "GET",
        f"/v1/snapshots/{JOB}/r0/0/1/data",
        headers={"authorization": f"Bearer {token}", "range": f"bytes=0-{size - 1}"},
    )
    response = conn.getresponse()  # the head only: the body waits in the socket
    assert response.status == 206
    for step in (2, 3, 4):  # step 1 is retired by step 2, but its response is unread
        pub.publish(step, state_of(step), {})
        served_then_handed_back(server, token, step)
    assert pub.reused == 1  # step 4 reused step 2's segment; step 1's was not handed back
    body = response.read()
    assert body == bytes(want[:size].numpy())
    conn.close()
    # Step 1's own segment (step 3's may be handed back too by now: its fetch's leases end
    # when that fetch's connections close, on their own time).
    wait_for(lambda: any("-s1-" in n for n in names(shm, ".free")), "step 1's segment handed back")
    pub.publish(5, state_of(5), {})
    assert pub.reused == 2
    assert_bitwise_equal(fetch(server, token, 5), state_of(5))


def test_a_durable_write_keeps_its_segment(sidecars: Start, token: str, tmp_path: Path) -> None:
    from fthsdp.services.checkpoint.client import request_durable, wait_durable

    server = sidecars(retain_snapshots=1)
    pub = publisher(server, token)
    pub.publish(1, state_of(1), {})
    request_durable(server.url, token, job=JOB, replica="r0", rank=0, step=1, world_size=1)
    pub.publish(2, state_of(2), {})
    wait_durable(server.url, token, job=JOB, step=1, rank=0, timeout=DEADLINE)
    # The durable write verifies every chunk against the checksums as it writes: it would have
    # failed had step 1's segment been overwritten under it.
    served_then_handed_back(server, token, 2)
    pub.publish(3, state_of(3), {})
    assert_bitwise_equal(fetch(server, token, 3), state_of(3))


def test_a_publish_that_fails_midway_serves_nothing_and_leaves_no_file(
    sidecars: Start, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = sidecars(retain_snapshots=1)
    shm = server.config.shm_dir
    pub = publisher(server, token)
    for step in (1, 2):
        pub.publish(step, state_of(step), {})
        served_then_handed_back(server, token, step)
    # Step 1's segment comes back, ready to be overwritten, once its fetch's connections close.
    wait_for(lambda: bool(names(shm, ".free")), "step 1's segment handed back")

    def crash(mapped: object, layout: object, tensors: object) -> None:
        raise RuntimeError("the publisher died while copying")

    monkeypatch.setattr(client_publish, "_copy_into", crash)
    with pytest.raises(RuntimeError, match="died while copying"):
        pub.publish(3, state_of(3), {})
    monkeypatch.undo()
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == [2]
    assert len(names(shm, ".snap")) == 1 and names(shm, ".free") == []  # the segment went away
    assert_bitwise_equal(fetch(server, token, 2), state_of(2))
    pub.publish(3, state_of(3), {})
    assert_bitwise_equal(fetch(server, token, 3), state_of(3))


def test_forget_unlinks_handed_back_segments_too(sidecars: Start, token: str) -> None:
    server = sidecars(retain_snapshots=1)
    shm = server.config.shm_dir
    old = publisher(server, token)
    for step in (1, 2):
        old.publish(step, state_of(step), {})
        served_then_handed_back(server, token, step)
    wait_for(lambda: len(names(shm, ".free")) == 1, "step 1's segment handed back")
    assert len(names(shm, ".snap")) == 1
    new = publisher(server, token)
    assert new.forget_earlier() == 1
    assert list(shm.iterdir()) == []
    new.publish(1, state_of(1), {})  # a fresh history, in a fresh segment
    assert new.reused == 0
    assert_bitwise_equal(fetch(server, token, 1), state_of(1))


def test_a_handed_back_name_that_exists_is_never_replaced(sidecars: Start, token: str) -> None:
    server = sidecars(retain_snapshots=1)
    shm = server.config.shm_dir
    pub = publisher(server, token)
    pub.publish(1, state_of(1), {})
    (first,) = names(shm, ".snap")
    (shm / (first + ".free")).write_bytes(b"someone else's")
    served_then_handed_back(server, token, 1)
    pub.publish(2, state_of(2), {})
    served_then_handed_back(server, token, 2)
    assert (shm / (first + ".free")).read_bytes() == b"someone else's"
    assert not (shm / first).exists()  # unlinked instead of handed back
    pub.publish(3, state_of(3), {})  # nothing to reuse: step 1's was not handed back
    served_then_handed_back(server, token, 3)
    pub.publish(4, state_of(4), {})
    assert pub.reused == 1  # step 2's segment
    assert_bitwise_equal(fetch(server, token, 4), state_of(4))
    assert (shm / (first + ".free")).read_bytes() == b"someone else's"
