"""The checkpoint sidecar over real HTTP (uvicorn on port 0): publish, fetch, durable, positions,
auth and input validation."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch

from fthsdp.services.checkpoint import snapshots
from fthsdp.services.checkpoint.client import (
    SnapshotPublisher,
    Source,
    fetch_snapshot,
    get_position,
    latest_checkpoint,
    list_snapshots,
    put_position,
    request_durable,
    restore_latest,
    wait_durable,
)
from fthsdp.services.checkpoint.client_errors import (
    AuthError,
    ConflictError,
    GoneError,
    InvalidArgumentError,
    NotFoundError,
)
from fthsdp.services.checkpoint.server import CheckpointServer
from tests.integration.test_checkpoint_support import (
    JOB,
    assert_bitwise_equal,
    make_state,
    sidecars,
)

__all__ = ["sidecars"]
Start = Callable[..., CheckpointServer]
DEADLINE = timedelta(seconds=20)


def publisher(
    server: CheckpointServer, token: str, replica: str = "r0", rank: int = 0
) -> SnapshotPublisher:
    return SnapshotPublisher(
        server.url, token, job=JOB, replica_id=replica, rank=rank, shm_dir=server.config.shm_dir
    )


def test_round_trip_is_bitwise_for_every_dtype(sidecars: Start, token: str) -> None:
    server = sidecars()
    state = make_state()
    publisher(server, token).publish(5, state, {"quorum_id": 3, "note": "x"})
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == [5]

    fetched = fetch_snapshot(
        [Source(server.url, "r0")], job=JOB, rank=0, step=5, token=token, deadline=DEADLINE
    )
    assert_bitwise_equal(fetched.tensors, state)
    assert fetched.meta == {"quorum_id": 3, "note": "x"}
    assert fetched.step == 5
    assert fetched.bytes_fetched >= sum(t.numel() * t.element_size() for t in state.values())

    into = {name: torch.zeros_like(t) for name, t in state.items()}
    into["transposed"] = torch.zeros(40, 60).t()  # non-contiguous destination
    pointers = {name: t.data_ptr() for name, t in into.items()}
    again = fetch_snapshot(
        [Source(server.url, "r0")],
        job=JOB,
        rank=0,
        step=5,
        token=token,
        deadline=DEADLINE,
        into=into,
    )
    assert_bitwise_equal(into, state)
    assert all(again.tensors[n] is into[n] and into[n].data_ptr() == p for n, p in pointers.items())


def test_into_with_wrong_shape_is_refused(sidecars: Start, token: str) -> None:
    server = sidecars()
    publisher(server, token).publish(1, {"a": torch.ones(4)}, {})
    with pytest.raises(InvalidArgumentError, match="float32"):
        fetch_snapshot(
            [Source(server.url, "r0")], job=JOB, rank=0, step=1, token=token,
            deadline=DEADLINE, into={"a": torch.ones(5)},
        )  # fmt: skip


def test_publish_does_not_wait_for_checksums(
    sidecars: Start, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = snapshots.compute_checksums

    def slow(data: memoryview, chunk: int) -> tuple[int, ...]:
        release.wait(30)
        return real(data, chunk)

    monkeypatch.setattr(snapshots, "compute_checksums", slow)
    server = sidecars(checksum_wait=timedelta(milliseconds=100))
    state = make_state()
    publisher(server, token).publish(1, state, {})  # returns although checksums are blocked
    with pytest.raises(TimeoutError):
        fetch_snapshot(
            [Source(server.url, "r0")], job=JOB, rank=0, step=1, token=token,
            deadline=timedelta(milliseconds=500),
        )  # fmt: skip
    release.set()
    fetched = fetch_snapshot(
        [Source(server.url, "r0")], job=JOB, rank=0, step=1, token=token, deadline=DEADLINE
    )
    assert_bitwise_equal(fetched.tensors, state)


def test_snapshot_retention_unlinks_old_files(sidecars: Start, token: str) -> None:
    server = sidecars(retain_snapshots=2)
    pub = SnapshotPublisher(
        server.url, token, job=JOB, replica_id="r0", rank=0, shm_dir=server.config.shm_dir,
        reuse=False,
    )  # fmt: skip
    for step in range(1, 5):
        pub.publish(step, {"x": torch.full((10,), float(step))}, {})
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == [3, 4]
    assert len(list(server.config.shm_dir.iterdir())) == 2
    with pytest.raises(GoneError, match="garbage-collected"):
        fetch_snapshot(
            [Source(server.url, "r0")], job=JOB, rank=0, step=1, token=token, deadline=DEADLINE
        )
    with pytest.raises(NotFoundError):
        fetch_snapshot(
            [Source(server.url, "r0")], job=JOB, rank=0, step=99, token=token, deadline=DEADLINE
        )
    with pytest.raises(ConflictError):
        pub.publish(4, {"x": torch.zeros(10)}, {})
    assert len(list(server.config.shm_dir.iterdir())) == 2  # the refused copy was removed
    got = fetch_snapshot(
        [Source(server.url, "r0")], job=JOB, rank=0, step=4, token=token, deadline=DEADLINE
    )
    assert torch.equal(got.tensors["x"], torch.full((10,), 4.0))
    server.stop()
    server.stop()  # idempotent
    assert list(server.config.shm_dir.iterdir()) == []  # the sidecar unlinks what it owns


def test_a_new_process_drops_its_predecessors_snapshots_and_starts_a_new_history(
    sidecars: Start, token: str
) -> None:
    """The sidecar outlives a rank's process; the next process of that rank forgets what the
    last one published (the same steps may come again from another history) and may publish
    steps older than those the last one had collected."""
    server = sidecars(retain_snapshots=2)
    old = publisher(server, token)
    for step in range(1, 5):
        old.publish(step, {"x": torch.full((10,), float(step))}, {})
    other = publisher(server, token, replica="r1")
    other.publish(7, {"x": torch.zeros(10)}, {})
    with httpx.Client(base_url=server.url) as http:  # the route wants the token like the rest
        assert http.delete(f"/v1/snapshots/{JOB}/r0/0").status_code == 401
    new = publisher(server, token)
    assert new.forget_earlier() == 2  # steps 3 and 4 were retained
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == []
    assert list_snapshots(server.url, token, job=JOB, replica="r1", rank=0) == [7]
    files = [p.name for p in server.config.shm_dir.iterdir()]
    assert len(files) == 1 and "-r1-" in files[0], files  # r0's files were unlinked
    new.publish(3, {"x": torch.full((10,), -3.0)}, {})  # no conflict with the old step 3
    new.publish(1, {"x": torch.full((10,), -1.0)}, {})  # no longer "garbage-collected"
    got = fetch_snapshot(
        [Source(server.url, "r0")], job=JOB, rank=0, step=3, token=token, deadline=DEADLINE
    )
    assert torch.equal(got.tensors["x"], torch.full((10,), -3.0))
    assert new.forget_earlier() == 2
    assert new.forget_earlier() == 0


def test_retention_deletes_only_files_the_sidecar_owns(sidecars: Start, token: str) -> None:
    """One file holds one snapshot, only a publisher's own file is adopted, and a name reused
    after adoption is not deleted by retention (issue: retention unlinked a file no publisher
    wrote, and a file registered under two keys was deleted while the second still used it)."""
    server = sidecars(retain_snapshots=1)
    shm = server.config.shm_dir
    entry = {"name": "a", "dtype": "float32", "shape": [16], "offset": 0, "nbytes": 64}
    auth = {"authorization": f"Bearer {token}"}
    (shm / "shared.snap").write_bytes(bytes(64))
    (shm / "target.snap").write_bytes(bytes(64))
    os.link(shm / "target.snap", shm / "alias.snap")  # a second name of another file
    with httpx.Client(base_url=server.url, headers=auth) as http:

        def register(replica: str, step: int, file: str) -> httpx.Response:
            body = {"file": file, "total_bytes": 64, "tensors": [entry], "meta": {}}
            return http.post(f"/v1/snapshots/{JOB}/{replica}/0/{step}", json=body)

        assert register("r0", 1, "shared.snap").status_code == 201
        second = register("r1", 1, "shared.snap")
        assert second.status_code == 409, second.text
        assert "one file holds one snapshot" in second.json()["detail"]
        assert register("r0", 2, "shared.snap").status_code == 409  # nor two steps of one key
        linked = register("r2", 1, "alias.snap")
        assert linked.status_code == 400 and "exactly one name" in linked.json()["detail"]
        # The publisher's name now points at a file the sidecar never adopted: retention of
        # step 1 (pushed out by step 2) must leave that file alone.
        os.replace(shm / "target.snap", shm / "shared.snap")
        (shm / "next.snap").write_bytes(bytes(64))
        assert register("r0", 2, "next.snap").status_code == 201
    assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == [2]
    assert (shm / "shared.snap").exists() and (shm / "alias.snap").exists()
    server.stop()
    assert not (shm / "next.snap").exists()  # what it owned is gone at stop
    assert (shm / "shared.snap").exists()


def test_the_shm_dir_is_private(sidecars: Start, token: str, tmp_path: Path) -> None:
    """Created with mode 0700; one that others may write to is refused at start (anyone who can
    write there could hand the sidecar files to adopt and delete)."""
    server = sidecars()
    assert server.config.shm_dir.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(ValueError, match="writable by other users"):
        sidecars(shm_dir=shared)
    link = tmp_path / "link"
    link.symlink_to(server.config.shm_dir)
    with pytest.raises(ValueError, match="not a link"):
        sidecars(shm_dir=link)


def test_auth_is_required_on_the_api_only(sidecars: Start, token: str) -> None:
    server = sidecars()
    path = f"/v1/snapshots/{JOB}/r0/0"
    with httpx.Client(base_url=server.url) as http:
        for headers in ({}, {"authorization": "Bearer " + "w" * 24}, {"authorization": token}):
            answer = http.get(path, headers=headers)
            assert answer.status_code == 401
            assert answer.json()["error"] == "unauthorized"
            assert token not in answer.text
        assert http.get(path, headers={"authorization": f"Bearer {token}"}).json() == {"steps": []}
        assert http.get("/livez").status_code == 200
        assert http.get("/readyz").json() == {"status": "ready"}
        assert "/v1/checkpoints" in http.get("/openapi.json").json()["paths"]
    with pytest.raises(AuthError):
        list_snapshots(server.url, "z" * 20, job=JOB, replica="r0", rank=0)


def _raw_http(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        return sock.recv(65536)


def test_malformed_and_oversized_requests_are_refused(sidecars: Start, token: str) -> None:
    server = sidecars()
    shm = server.config.shm_dir
    publisher(server, token).publish(1, {"a": torch.ones(600_000)}, {})  # > max range
    auth = {"authorization": f"Bearer {token}"}
    data = f"/v1/snapshots/{JOB}/r0/0/1/data"
    good = {"file": "f.snap", "total_bytes": 64, "meta": {}}
    entry = {"name": "a", "dtype": "float32", "shape": [16], "offset": 0, "nbytes": 64}
    overlapping = {**entry, "name": "b", "offset": 32, "nbytes": 32, "shape": [8]}
    positions, many = f"/v1/positions/{JOB}/r0", {str(i): i for i in range(65)}
    (shm / "f.snap").write_bytes(bytes(64))
    os.symlink(shm / "f.snap", shm / "link.snap")
    os.mkfifo(shm / "fifo.snap")  # opened blocking, it held a worker thread for good
    (server.config.shm_dir.parent / "outside.snap").write_bytes(bytes(64))
    with httpx.Client(base_url=server.url, headers=auth) as http:

        def register(step: object, **changes: object) -> httpx.Response:
            body = {**good, "tensors": [entry], **changes}
            return http.post(f"/v1/snapshots/{JOB}/r0/0/{step}", json=body)

        cases = {
            "huge range": (http.get(data, headers={"range": "bytes=0-999999999999"}), 416),
            "range past end": (http.get(data, headers={"range": "bytes=2400000-2400001"}), 416),
            "multi range": (http.get(data, headers={"range": "bytes=0-1,5-6"}), 400),
            "no range on big object": (http.get(data), 416),
            "bad dtype": (register(2, tensors=[{**entry, "dtype": "complex64"}]), 400),
            "pickle dtype": (register(2, tensors=[{**entry, "dtype": "object"}]), 400),
            "traversal": (register(2, file="../outside.snap"), 400),
            "absolute": (register(2, file=str(shm / "f.snap")), 400),
            "symlink": (register(2, file="link.snap"), 400),
            "fifo": (register(2, file="fifo.snap"), 400),
            "size mismatch": (register(2, total_bytes=128), 400),
            "overlap": (register(2, tensors=[entry, overlapping]), 400),
            "nbytes lie": (register(2, tensors=[{**entry, "nbytes": 60}]), 400),
            "negative step": (register(-1), 400),
            "bad job": (http.get("/v1/snapshots/a..b/r0/0"), 400),
            "unknown step": (http.get(f"/v1/snapshots/{JOB}/r0/0/7/manifest"), 404),
            "too many keys": (http.put(positions, json={"step": 1, "position": many}), 400),
            "bool position": (http.put(positions, json={"step": 1, "position": {"a": True}}), 400),
        }  # fmt: skip
        for name, (answer, status) in cases.items():
            assert answer.status_code == status, (name, answer.text)
            assert set(answer.json()) == {"error", "detail"}, name
        assert "complex64" in cases["bad dtype"][0].json()["detail"]
        assert list_snapshots(server.url, token, job=JOB, replica="r0", rank=0) == [1]
        ok = http.get(data, headers={"range": "bytes=4-11"})
        assert ok.status_code == 206
        assert ok.content == torch.ones(2).numpy().tobytes()
        assert ok.headers["content-range"] == "bytes 4-11/2400000"
    # a declared 1 TB body is refused from its headers alone, before anything is read
    head = (
        f"POST /v1/snapshots/{JOB}/r0/0/3 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n"
        "content-type: application/json\r\ncontent-length: 1000000000000\r\n\r\n"
    )
    answer = _raw_http(server.url, head.encode())
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
    # the same without a declared length: counted as it arrives, and still 413
    limit = server.config.max_body_bytes
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(limit // len(chunk) + 2))
    head = (
        f"POST /v1/snapshots/{JOB}/r0/0/3 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n"
        "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    answer = _raw_http(server.url, head.encode() + body + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:100]


def test_positions_round_trip_at_step_and_survive_restart(
    sidecars: Start, token: str, tmp_path: Path
) -> None:
    server = sidecars(root=tmp_path / "p")
    url = server.url
    assert get_position(url, token, job=JOB, replica="r0") is None
    for step, offset in ((1, 10), (2, 20), (5, 50)):
        put_position(
            url, token, job=JOB, replica="r0", step=step, position={"shard0": offset, "epoch": 0}
        )
    put_position(url, token, job=JOB, replica="r1", step=9, position={"shard0": 999})

    def check(url: str) -> None:
        assert get_position(url, token, job=JOB, replica="r0", at_step=4).step == 2  # type: ignore[union-attr]
        assert get_position(url, token, job=JOB, replica="r0", at_step=5).position == {
            "shard0": 50,
            "epoch": 0,
        }  # type: ignore[union-attr]
        assert get_position(url, token, job=JOB, replica="r0").step == 5  # type: ignore[union-attr]
        assert get_position(url, token, job=JOB, replica="r0", at_step=0) is None
        assert get_position(url, token, job=JOB, replica="r1").position == {"shard0": 999}  # type: ignore[union-attr]

    check(url)
    server.stop()
    restarted = sidecars(root=tmp_path / "p")
    check(restarted.url)
    # a replica restored to step 3 rewinds: the abandoned step-5 record no longer answers
    put_position(
        restarted.url, token, job=JOB, replica="r0", step=3, position={"shard0": 31, "epoch": 0}
    )
    latest = get_position(restarted.url, token, job=JOB, replica="r0")
    assert latest is not None
    assert latest.step == 3
    assert latest.position["shard0"] == 31


def test_durable_checkpoints_restore_and_retention(sidecars: Start, token: str) -> None:
    server = sidecars(retain_checkpoints=2, retain_snapshots=2)
    url = server.url
    states = {}
    for step in range(1, 5):
        for rank in range(2):
            states[step, rank] = make_state(seed=10 * step + rank)
            publisher(server, token, rank=rank).publish(step, states[step, rank], {"step": step})
            request_durable(url, token, job=JOB, replica="r0", rank=rank, step=step, world_size=2)
        for rank in range(2):
            assert (
                wait_durable(url, token, job=JOB, step=step, rank=rank, timeout=DEADLINE).state
                == "done"
            )
    assert latest_checkpoint(url, token, job=JOB, world_size=2) == 4
    kept = sorted(p.name for p in (server.config.durable_root / JOB).iterdir())
    assert kept == ["step-000000000003", "step-000000000004"]
    for rank in range(2):
        restored = restore_latest(url, token, JOB, rank, 2)
        assert restored is not None
        assert restored.step == 4
        assert restored.meta == {"step": 4}
        assert_bitwise_equal(restored.tensors, states[4, rank])
    assert restore_latest(url, token, "other-job", 0, 1) is None
    with pytest.raises(NotFoundError):
        request_durable(url, token, job=JOB, replica="r0", rank=0, step=1, world_size=2)  # GC'd


def test_restore_skips_corrupt_and_partial_steps(sidecars: Start, token: str) -> None:
    server = sidecars(retain_checkpoints=5)
    url = server.url
    pub = publisher(server, token)
    states = {}
    for step in (1, 2):
        states[step] = make_state(seed=step)
        pub.publish(step, states[step], {})
        request_durable(url, token, job=JOB, replica="r0", rank=0, step=step, world_size=1)
        wait_durable(url, token, job=JOB, step=step, rank=0, timeout=DEADLINE)
    step_dir = server.config.durable_root / JOB
    data = step_dir / "step-000000000002" / "rank-0" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))  # silent corruption of the newest step
    partial = step_dir / "step-000000000003"
    (partial / ".tmp-rank-0-dead").mkdir(parents=True)  # a writer killed before its rename
    (partial / ".tmp-rank-0-dead" / "data.bin").write_bytes(b"half")
    restored = restore_latest(url, token, JOB, 0, 1)
    assert restored is not None
    assert restored.step == 1
    assert_bitwise_equal(restored.tensors, states[1])


def test_metrics_count_requests_and_bytes(sidecars: Start, token: str) -> None:
    server = sidecars()
    publisher(server, token).publish(1, {"a": torch.ones(1000)}, {})
    fetch_snapshot(
        [Source(server.url, "r0")], job=JOB, rank=0, step=1, token=token, deadline=DEADLINE
    )
    text = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {token}"}).text
    assert "# HELP fthsdp_checkpoint_requests_total" in text
    assert 'fthsdp_checkpoint_requests_total{route="snapshot_data",status="206"} 1.0' in text
    assert "fthsdp_checkpoint_served_bytes_total 4000.0" in text
    assert "fthsdp_checkpoint_snapshots_registered_total 1.0" in text
    assert "fthsdp_checkpoint_checksum_seconds_count 1.0" in text


def test_stop_is_idempotent_and_releases_the_port(sidecars: Start) -> None:
    server = sidecars()
    host, port = server.address
    server.stop()
    server.stop()
    deadline = time.monotonic() + 5
    while True:  # the port is free again once the listener is closed
        try:
            socket.create_connection((host, port), timeout=1).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "still accepting after stop()"
        time.sleep(0.02)
